"""The target on an inference engine (vLLM): its servers' features fed to TargetForward.

Nothing is imported here: vLLM imports :mod:`.vllm_connector` into its own processes (its environment may lack
our dependencies), and ``dflash-flow --help`` must stay cheap.
"""
