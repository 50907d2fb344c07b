"""Built-in stage types: thin adapters over ``data/``, ``model/`` and ``observe/``, one file per stage
(sources share one). They are declared in the ``dflash_flow.stages`` entry-point group of
``pyproject.toml`` and resolve by name through ``dflash_flow.core.registry``, like any plugin; importing
this package imports none of them."""
