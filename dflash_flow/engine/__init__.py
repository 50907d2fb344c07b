"""The target on an inference engine (vLLM): its servers' features fed to TargetForward.

Nothing is imported here: vLLM imports :mod:`dflash_flow.engine.vllm_connector` into its own processes (its
environment may lack our dependencies), and ``dflash-flow --help`` must stay cheap.

* :mod:`.layers`      the one layer-id mapping (ours -> vLLM: +1)
* :mod:`.config`      ``model.engine``: :class:`~.config.EngineConfig` (attrs, torch-free)
* :mod:`.http`        the HTTP client and the server pool (spread, health, failover), shared with
                      ``regenerate --server``
* :mod:`.handover`    the feature files: how the connector writes them and how the client reads them
* :mod:`.vllm_connector`  our KV connector, loaded by vLLM (``kv_connector_module_path``)
* :mod:`.checks`      the feature checks (every batch; at start against transformers or by statistics)
* :mod:`.backend`     :class:`~.backend.EngineBackend`, the TargetBackend over vLLM servers
* :mod:`.command`     the exact vLLM server command (``dflash-flow serve-target``)
* :mod:`.launch`      local servers started, watched and always stopped (:class:`~.launch.LocalServers`)
* :mod:`.guard`       the small process between us and a server that kills it when we die
"""
