"""``python -m dflash_flow`` (what ``torchrun -m dflash_flow run FILE`` starts on every rank)."""

from dflash_flow.cli import main

# Guarded: the tokenizing worker processes are spawned, and spawn imports the parent's main module.
if __name__ == "__main__":
    main()
