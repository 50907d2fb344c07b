"""Built-in stage types: thin adapters over ``data/``, ``model/`` and ``observe/``, declared in the
``dflash_flow.stages`` entry-point group (resolved by name like any plugin; importing this imports none)."""
