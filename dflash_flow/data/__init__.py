"""Pure data-side logic: chat templates and loss masks, record readers, the epoch batch plan, collate.

Importing this package does not import torch (only `collate`'s functions do, when called)."""

# Import the modules themselves (``from dflash_flow.data.records import read_records``): nothing is re-exported here.
