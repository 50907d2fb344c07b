"""Pure data-side logic: chat templates and loss masks, record readers, the epoch batch plan and padding. Nothing is
re-exported here (import the modules themselves); importing this package does not import torch."""
