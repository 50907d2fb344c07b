"""Model side of DFlash: drafter, objective, target loading, optimizer, export, speculative decoding.

Submodules import torch; import them directly (``from dflash_flow.model.drafter import ...``) so that
importing this package stays cheap.
"""
