"""dflash-flow: train DFlash speculative-decoding drafters as a typed, observable dataflow pipeline."""

__version__ = "0.1.0"
