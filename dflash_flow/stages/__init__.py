"""Built-in stage types. Registered by import path so that listing or validating never imports torch."""

from dflash_flow.core.registry import register_builtin

_BUILTINS = {
    # generic stages (runtime tests, benchmarks, plumbing)
    "Range": "dflash_flow.stages.generic:Range",
    "Delay": "dflash_flow.stages.generic:Delay",
    "Discard": "dflash_flow.stages.generic:Discard",
    # data side
    "ChatSource": "dflash_flow.stages.sources:ChatSource",
    "TokenizedSource": "dflash_flow.stages.sources:TokenizedSource",
    "EmbeddedChatSource": "dflash_flow.stages.embedded:EmbeddedChatSource",
    "Bucketer": "dflash_flow.stages.bucketer:Bucketer",
    "Interleaver": "dflash_flow.stages.interleaver:Interleaver",
    "Padder": "dflash_flow.stages.padder:Padder",
    # model side
    "TargetForward": "dflash_flow.stages.target_forward:TargetForward",
    "DrafterStep": "dflash_flow.stages.drafter_step:DrafterStep",
    "SpecDecodeEval": "dflash_flow.stages.spec_eval:SpecDecodeEval",
    # observability
    "Monitor": "dflash_flow.stages.monitor:Monitor",
}

for _name, _target in _BUILTINS.items():
    register_builtin(_name, _target)
