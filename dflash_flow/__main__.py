"""``python -m dflash_flow`` (what ``torchrun -m dflash_flow run FILE`` starts on every rank)."""

from dflash_flow.cli import main

main()
