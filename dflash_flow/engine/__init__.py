"""The target on an inference engine (vLLM): its servers' features fed to TargetForward.

Nothing is imported here: vLLM imports :mod:`.vllm_connector` into its own processes (its environment may lack
our dependencies), and ``dflash-flow --help`` must stay cheap. Modules: ``config`` (``model.engine``),
``http``/``http_client`` (the server pool and client, shared with ``regenerate --server``), ``handover`` (the
feature files), ``vllm_connector``, ``checks``, ``backend`` (:class:`~.backend.EngineBackend`), ``command``
(the vLLM server command and the layer-id mapping), ``launch`` and ``guard`` (local servers).
"""
