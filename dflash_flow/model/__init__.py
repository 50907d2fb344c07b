"""Model side of DFlash: drafter, objective, target loading, optimizer, export, speculative decoding.
Submodules import torch: import them directly (``from dflash_flow.model.drafter import ...``) to keep
importing this package cheap."""

import threading

#: Held by every stage while it builds or loads a model: transformers (and torch's meta-device helpers) patch
#: process-wide state while they build one, so two replicas loading at once could see each other's half-built
#: modules ("Cannot copy out of meta tensor"). Forward and backward passes run concurrently as usual.
MODEL_LOAD_LOCK = threading.RLock()
