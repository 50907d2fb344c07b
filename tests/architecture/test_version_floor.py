"""The lower bounds in pyproject.toml are true: every version-gated API the package calls is listed here
with the release it appeared in (as the code calls it), and

- each listed release is at or below pyproject's floor for its distribution (lower the floor below one and
  this fails, naming the API);
- each listed API is there, in the form the code calls, in the installed torch / transformers / mlflow;
- an AST scan of ``dflash_flow/`` (imports resolved, so ``F.x`` is ``torch.nn.functional.x``) finds every
  use of a watched, version-sensitive API; one that is not listed fails (add it to ``USED`` with the
  release it appeared in), and a listed one the code no longer uses fails too (drop it, and maybe the floor).

Only what the scan can see is enforced by it: methods called on objects (``client.log_batch``) and keywords
passed through a dict (``from_pretrained(**common)``) are listed in ``UNSCANNED`` by hand.
How each release was established: the ``evidence`` of each entry, and docs/dependencies.md.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflash_flow"
PYPROJECT = ROOT / "pyproject.toml"
CONSTRAINTS = ROOT / "requirements" / "cpu.txt"

# Releases the ranges must keep admitting: the GPU machine's torch 2.11 / transformers 5.17, CI's torch 2.13,
# and the torch 2.14 vLLM 0.33 pins.
MUST_ADMIT = {"torch": ["2.11.0", "2.13.0", "2.14.1"], "transformers": ["5.17.0"]}
NO_EXACT_PIN = ("torch", "transformers", "mlflow")


@dataclass(frozen=True)
class Gate:
    dist: str
    since: str  # the first release with the API in the form the code calls it
    evidence: str
    check: Callable[[], object] | None = None  # raises / returns False when the installed library lacks it


# --------------------------------------------------------------------------------------------- checks
def _schema(op: str) -> str:
    import torch

    return str(getattr(torch.ops.aten, op).default._schema)


def _schema_is(op: str, expected: str) -> Callable[[], bool]:
    return lambda: _schema(op) == expected


def _sdpa_gqa() -> bool:
    import torch
    import torch.nn.functional as F

    q, kv = torch.ones(1, 4, 2, 8), torch.ones(1, 2, 2, 8)
    return F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True).shape == q.shape


def _float8() -> bool:
    import torch

    return torch.tensor([0.5]).to(torch.float8_e4m3fn).float().item() == 0.5


def _total_norm() -> bool:
    import torch

    return float(torch.nn.utils.get_total_norm([torch.tensor([3.0, 4.0])])) == 5.0


def _fully_shard() -> bool:
    from torch.distributed.fsdp import fully_shard

    return callable(fully_shard)


def _fsdp_mp() -> bool:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    return policy.reduce_dtype == torch.float32 and "mp_policy" in inspect.signature(fully_shard).parameters


def _fsdp_gradient_sync() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return callable(FSDPModule.set_requires_gradient_sync)


def _dcp(name: str) -> Callable[[], bool]:
    def check() -> bool:
        from torch.distributed.checkpoint import state_dict

        return callable(getattr(state_dict, name))

    return check


def _dcp_options() -> bool:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return options.full_state_dict and options.cpu_offload


def _compile() -> bool:
    import torch

    return "dynamic" in inspect.signature(torch.compile).parameters


def _qwen3(name: str) -> Callable[[], bool]:
    def check() -> bool:
        from transformers.models.qwen3 import modeling_qwen3

        return hasattr(modeling_qwen3, name)

    return check


def _qwen3_config() -> bool:
    from transformers import Qwen3Config

    return Qwen3Config is not None


def _qwen3_layer_types() -> bool:
    from transformers import Qwen3Config

    return Qwen3Config(num_hidden_layers=2, layer_types=["full_attention"] * 2).layer_types == ["full_attention"] * 2


def _config_dtype() -> bool:
    import torch
    from transformers import Qwen3Config

    return Qwen3Config(dtype=torch.bfloat16).dtype == torch.bfloat16


def _causal_lm_mapping() -> bool:
    from transformers import Qwen3Config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[Qwen3Config].__name__ == "Qwen3ForCausalLM"


def _rope_parameters() -> bool:
    from transformers import Qwen3Config

    config = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    return config.rope_parameters["rope_theta"] == 12345.0


def _dynamic_cache_config() -> bool:
    from transformers import DynamicCache

    return "config" in inspect.signature(DynamicCache.__init__).parameters


def _from_pretrained_dtype() -> bool:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).dtype == torch.float64


def _log_batch_synchronous() -> bool:
    from mlflow import MlflowClient

    return "synchronous" in inspect.signature(MlflowClient.log_batch).parameters


def _sqlite_default() -> bool:
    from mlflow.store.tracking import DEFAULT_TRACKING_URI

    return DEFAULT_TRACKING_URI.startswith("sqlite:")


_FLASH_CPU = ("aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, "
              "float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> "
              "(Tensor output, Tensor logsumexp)")
_FLASH_CPU_BACKWARD = ("aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, "
                       "Tensor key, Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, "
                       "Tensor? attn_mask=None, float? scale=None) -> (Tensor grad_query, Tensor grad_key, "
                       "Tensor grad_value)")
_FUSED_RMS = ("aten::_fused_rms_norm(Tensor input, int[] normalized_shape, Tensor? weight, float? eps) -> "
              "(Tensor, Tensor)")
_WHEEL = "the op's schema in torchgen/packaged/ATen/native/native_functions.yaml of the torch wheels"

# ------------------------------------------------------------------------------ the gated APIs we call
# Keyed by the name the scan reports: a resolved dotted name, or "callee(keyword=)" for a keyword argument.
USED: dict[str, Gate] = {
    "torch.ops.aten._fused_rms_norm": Gate(
        "torch", "2.9", f"{_WHEEL}: 2.9.0 has this schema; 2.8.0 has another op of that name "
        "(int normalized_shape_ndim, one output, MPS only)", _schema_is("_fused_rms_norm", _FUSED_RMS)),
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": Gate(
        "torch", "2.5", f"{_WHEEL}: this schema in 2.5.0, 2.6.0, 2.8.0, 2.9.0 (older releases not checked)",
        _schema_is("_scaled_dot_product_flash_attention_for_cpu", _FLASH_CPU)),
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": Gate(
        "torch", "2.5", f"{_WHEEL}: this schema in 2.5.0, 2.6.0, 2.8.0, 2.9.0 (older releases not checked)",
        _schema_is("_scaled_dot_product_flash_attention_for_cpu_backward", _FLASH_CPU_BACKWARD)),
    "torch.nn.functional.scaled_dot_product_attention(enable_gqa=)": Gate(
        "torch", "2.5", "torch/nn/functional.py of the 2.5.0 wheel has enable_gqa; the 2.5 release notes add it",
        _sdpa_gqa),
    "torch.nn.functional.scaled_dot_product_attention(scale=)": Gate(
        "torch", "2.5", "in the 2.5.0 wheel's torch/nn/functional.py (documented since 2.1)", _sdpa_gqa),
    "torch.float8_e4m3fn": Gate(
        "torch", "2.5", "in the 2.5.0 wheel's torch/_C/__init__.pyi (documented since 2.1)", _float8),
    "torch.nn.utils.get_total_norm": Gate(
        "torch", "2.6", "torch/nn/utils/__init__.py: absent in the 2.5.0 wheel, exported in 2.6.0", _total_norm),
    "torch.distributed.fsdp.fully_shard": Gate(
        "torch", "2.6", "torch/distributed/fsdp/__init__.py: absent in the 2.5.0 wheel (only "
        "torch.distributed._composable.fsdp), exported in 2.6.0", _fully_shard),
    "torch.distributed.fsdp.fully_shard(mp_policy=)": Gate(
        "torch", "2.6", "_fully_shard.py of the 2.6.0 wheel (fully_shard is not exported in 2.5.0)", _fsdp_mp),
    "torch.distributed.fsdp.MixedPrecisionPolicy": Gate(
        "torch", "2.6", "torch/distributed/fsdp/__init__.py: absent in the 2.5.0 wheel, exported in 2.6.0", _fsdp_mp),
    "torch.distributed.fsdp.MixedPrecisionPolicy(reduce_dtype=)": Gate(
        "torch", "2.6", "a field of MixedPrecisionPolicy in the 2.6.0 wheel", _fsdp_mp),
    "torch.distributed.checkpoint.state_dict.get_model_state_dict": Gate(
        "torch", "2.5", "present in the 2.5.0 wheel (documented since 2.2)", _dcp("get_model_state_dict")),
    "torch.distributed.checkpoint.state_dict.set_model_state_dict": Gate(
        "torch", "2.5", "present in the 2.5.0 wheel (documented since 2.2)", _dcp("set_model_state_dict")),
    "torch.distributed.checkpoint.state_dict.get_model_state_dict(options=)": Gate(
        "torch", "2.5", "as get_model_state_dict", _dcp("get_model_state_dict")),
    "torch.distributed.checkpoint.state_dict.set_model_state_dict(options=)": Gate(
        "torch", "2.5", "as set_model_state_dict", _dcp("set_model_state_dict")),
    "torch.distributed.checkpoint.state_dict.StateDictOptions": Gate(
        "torch", "2.5", "full_state_dict and cpu_offload fields in the 2.5.0 wheel", _dcp_options),
    "torch.distributed.checkpoint.state_dict.StateDictOptions(full_state_dict=)": Gate(
        "torch", "2.5", "a field of StateDictOptions in the 2.5.0 wheel", _dcp_options),
    "torch.distributed.checkpoint.state_dict.StateDictOptions(cpu_offload=)": Gate(
        "torch", "2.5", "a field of StateDictOptions in the 2.5.0 wheel", _dcp_options),
    "torch.compile": Gate("torch", "2.0", "torch.compile (and its dynamic= argument) ships since 2.0", _compile),
    "torch.compile(dynamic=)": Gate("torch", "2.0", "as torch.compile", _compile),
    "transformers.Qwen3Config": Gate(
        "transformers", "4.51", "models/qwen3 absent in the 4.50.3 wheel, present in 4.51.0", _qwen3_config),
    "transformers.Qwen3Config(rope_parameters=)": Gate(
        "transformers", "5.0", "configuration_qwen3.py: no rope_parameters in the 4.57.6 wheel (rope_theta / "
        "rope_scaling; unknown keywords are kept but unused), rope_parameters in 5.0.0", _rope_parameters),
    "transformers.Qwen3Config(layer_types=)": Gate(
        "transformers", "4.53", "configuration_qwen3.py: no layer_types in the 4.52.4 wheel, present in 4.53.0",
        _qwen3_layer_types),
    "transformers.Qwen3Config(dtype=)": Gate(
        "transformers", "4.56", "the 4.56 release renamed torch_dtype to dtype (configs and from_pretrained)",
        _config_dtype),
    "transformers.DynamicCache": Gate(
        "transformers", "4.50", "cache_utils.DynamicCache in the 4.50.3 wheel (older not checked)",
        _dynamic_cache_config),
    "transformers.DynamicCache(config=)": Gate(
        "transformers", "4.56", "cache_utils.py: DynamicCache.__init__ takes config in the 4.56.0 wheel, not "
        "in 4.55.4", _dynamic_cache_config),
    "transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING": Gate(
        "transformers", "4.50", "in the 4.50.3 wheel (older not checked)", _causal_lm_mapping),
    "transformers.models.qwen3.modeling_qwen3.Qwen3MLP": Gate(
        "transformers", "4.51", "as Qwen3Config", _qwen3("Qwen3MLP")),
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm": Gate(
        "transformers", "4.51", "as Qwen3Config", _qwen3("Qwen3RMSNorm")),
    "transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding": Gate(
        "transformers", "4.51", "as Qwen3Config", _qwen3("Qwen3RotaryEmbedding")),
    "transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb": Gate(
        "transformers", "4.51", "as Qwen3Config", _qwen3("apply_rotary_pos_emb")),
}

# Gated APIs the scan cannot see (called on objects, or through **kwargs): listed by hand, checked the same way.
UNSCANNED: dict[str, Gate] = {
    "torch FSDPModule.set_requires_gradient_sync [model/trainer.py, on the fully_shard module]": Gate(
        "torch", "2.6", "torch/distributed/fsdp/_fully_shard/_fully_shard.py of the 2.6.0 wheel (2.5.0: only "
        "under torch.distributed._composable)", _fsdp_gradient_sync),
    "transformers from_pretrained / from_config (dtype=) [model/target.py, through **common]": Gate(
        "transformers", "4.56", "the 4.56 release renamed torch_dtype to dtype", _from_pretrained_dtype),
    "mlflow MlflowClient.log_batch(synchronous=) [observe/store.py]": Gate(
        "mlflow", "2.8", "async logging (and the synchronous flag) arrived in 2.8", _log_batch_synchronous),
    "mlflow default tracking URI sqlite:///mlflow.db [observe/store.resolve_tracking_uri, README]": Gate(
        "mlflow", "3.7", "mlflow.org self-hosting docs: 'As of MLflow 3.7.0, the default tracking backend has "
        "changed from file-based storage (./mlruns) to SQLite'", _sqlite_default),
}

# ------------------------------------------------------------------------ what the scan watches for
# A resolved name matching one of these must be a key of USED. Version-sensitive families: private aten
# ops (schemas change between releases), FSDP2 / DTensor / DCP / compile, attention and norm APIs that
# appeared in 2.x, float8 dtypes, transformers' cache / mask / attention-registry / layer helpers, its
# per-model modules, and keywords that appeared later than their function.
WATCHED = [re.compile(p) for p in (
    r"torch\.ops\.aten\._",
    r"torch\.nn\.attention\b",
    r"torch\.distributed\.(fsdp|tensor|device_mesh|checkpoint|_composable|pipelining)\b",
    r"torch\.float8_",
    r"torch\.(compile|compiler|export|accelerator|_dynamo|_inductor)\b",
    r"torch\.library\.(custom_op|triton_op|register_fake|register_autograd)\b",
    r"torch\.nn\.RMSNorm\b|torch\.nn\.functional\.rms_norm\b",
    r"torch\.nn\.utils\.(get_total_norm|clip_grads_with_norm_)\b",
    r"torch\.nn\.functional\.scaled_dot_product_attention\((enable_gqa|scale)=\)",
    r"transformers\.(\w+Cache|cache_utils)\b",
    r"transformers\.(masking_utils|modeling_layers|integrations|modeling_flash_attention_utils)\b",
    r"transformers\.modeling_utils\.(ALL_ATTENTION_FUNCTIONS|AttentionInterface)\b",
    r"transformers\.(AttentionInterface|GradientCheckpointingLayer)\b",
    r"transformers\.models\.",
    r"transformers\.Qwen3\w*\Z",
    r"transformers\..*\((rope_parameters|dtype|cache|layer_types)=\)",
    r"mlflow\.(genai|tracing|entities\.LoggedModel|log_model|initialize_logged_model)\b",
)]

# Where a watched name is not a gate at all (nothing so far).
NOT_GATED: set[str] = set()


# ------------------------------------------------------------------------------------------- scanning
def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted name, from every absolute import in the module (any scope)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def used_names(source: str, filename: str) -> dict[str, list[str]]:
    """Every torch / transformers / mlflow name the source uses (imports resolved), and each keyword
    argument of a call to one as ``callee(keyword=)``: ``{name: ["file:line", ...]}``."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found: dict[str, list[str]] = {}

    def add(name: str | None, node: ast.AST) -> None:
        if name and name.split(".")[0] in ("torch", "transformers", "mlflow"):
            found.setdefault(name, []).append(f"{filename}:{node.lineno}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                add(f"{node.module}.{a.name}", node)
        elif isinstance(node, ast.Attribute | ast.Name) and not isinstance(getattr(node, "ctx", None), ast.Store):
            add(_dotted(node, aliases), node)
        if isinstance(node, ast.Call):
            callee = _dotted(node.func, aliases)
            if callee:
                for kw in node.keywords:
                    if kw.arg is not None:
                        add(f"{callee}({kw.arg}=)", node)
    return found


def scan(paths: list[Path]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in paths:
        rel = path.relative_to(ROOT).as_posix()
        for name, where in used_names(path.read_text(encoding="utf-8"), rel).items():
            found.setdefault(name, []).extend(where)
    return found


def watched(name: str) -> bool:
    return name not in NOT_GATED and any(p.match(name) for p in WATCHED)


def unlisted(found: dict[str, list[str]]) -> list[str]:
    """Watched names the code uses that USED does not list: one line each."""
    return [f"{where[0]}: {name} is version-gated and not listed in USED (add it with the release it appeared in)"
            for name, where in sorted(found.items()) if watched(name) and name not in USED]


# ---------------------------------------------------------------------------------------- the floors
def declared() -> dict[str, SpecifierSet]:
    deps = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return {canonicalize_name(r.name): r.specifier for r in reqs}


def floor(spec: SpecifierSet) -> Version | None:
    """The lowest release the specifier admits (its >=, >, ~= or == bound); None when it has none."""
    bounds = [Version(s.version) for s in spec if s.operator in (">=", ">", "~=", "==", "===")]
    return max(bounds) if bounds else None


def floor_violations(specs: dict[str, SpecifierSet], gates: dict[str, Gate]) -> list[str]:
    problems = []
    for name, gate in sorted(gates.items()):
        spec = specs.get(gate.dist)
        if spec is None:
            problems.append(f"{name}: {gate.dist} is not a dependency in pyproject.toml")
            continue
        low = floor(spec)
        if low is None or low < Version(gate.since):
            problems.append(f"{name} appeared in {gate.dist} {gate.since}, but pyproject admits "
                            f"{gate.dist}{spec} (floor {low}): raise the floor to >={gate.since}")
    return problems


def _installed(dist: str) -> Version | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return Version(Version(version(dist)).public)
    except PackageNotFoundError:
        return None


ALL_GATES = {**USED, **UNSCANNED}


# -------------------------------------------------------------------------------------------- tests
def test_the_floor_admits_no_release_older_than_an_api_the_code_calls():
    assert floor_violations(declared(), ALL_GATES) == []


def test_every_watched_api_the_code_uses_is_listed_and_every_listed_one_is_used():
    found = scan(sorted(PACKAGE.rglob("*.py")))
    assert unlisted(found) == []
    stale = sorted(set(USED) - set(found))
    assert stale == [], f"listed in USED but no longer used by dflash_flow/: {stale} (remove; maybe lower the floor)"


@pytest.mark.parametrize("dist", ["torch", "transformers", "mlflow"])
def test_listed_apis_exist_in_the_installed_library(dist):
    if importlib.util.find_spec(dist) is None:
        pytest.skip(f"{dist} is not installed in this environment")
    missing = []
    for name, gate in sorted(ALL_GATES.items()):
        if gate.dist == dist and gate.check is not None:
            try:
                ok = gate.check()
            except Exception as exc:  # noqa: BLE001 - a missing module, attribute or keyword is the finding
                ok, name = False, f"{name} ({type(exc).__name__}: {exc})"
            if not ok:
                missing.append(name)
    assert missing == [], f"{dist} {_installed(dist)} lacks what the code calls: {missing}"


def test_ranges_admit_the_installed_and_the_known_good_releases_and_pin_nothing_exactly():
    specs = declared()
    for dist in NO_EXACT_PIN:
        assert not any(s.operator in ("==", "===") for s in specs[dist]), f"{dist} is pinned exactly: {specs[dist]}"
        assert any(s.operator in ("<", "<=") for s in specs[dist]), f"{dist} has no upper bound: {specs[dist]}"
    for dist, versions in MUST_ADMIT.items():
        for v in versions:
            assert specs[dist].contains(v, prereleases=False), f"{dist}{specs[dist]} refuses {v}"
    for dist in NO_EXACT_PIN:
        have = _installed(dist)
        if have is not None:
            assert specs[dist].contains(have), f"installed {dist} {have} is outside pyproject's {dist}{specs[dist]}"


def test_constraints_pin_every_dependency_exactly_inside_its_range():
    pins: dict[str, Version] = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = list(req.specifier)
            assert spec.operator == "==", f"{CONSTRAINTS.name}: {line} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    outside = [f"{d}=={pins[d]} vs {d}{s}" for d, s in declared().items() if d in pins and not s.contains(pins[d])]
    assert outside == []
    assert set(declared()) <= set(pins), f"not pinned in {CONSTRAINTS.name}: {set(declared()) - set(pins)}"


# ------------------------------------------------------------------- the checks themselves can fail
def test_a_floor_below_an_api_is_named():
    specs = declared()
    for name, gate in ALL_GATES.items():
        v = Version(gate.since)
        if v.release == (0,) * len(v.release):
            continue
        below = f"{v.major}.{v.minor - 1}" if v.minor else f"{v.major - 1}.99"
        lowered = {**specs, gate.dist: SpecifierSet(f">={below}")}
        assert any(p.startswith(f"{name} appeared in") for p in floor_violations(lowered, ALL_GATES)), name
    assert floor_violations({**specs, "torch": SpecifierSet("<3")}, ALL_GATES)  # no lower bound at all


def test_the_scan_names_an_unlisted_gated_api_with_its_line():
    source = (
        "import torch\n"
        "from torch.nn.attention.flex_attention import flex_attention\n"
        "import torch.nn.functional as F\n"
        "def f(q, k, v):\n"
        "    x = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)\n"
        "    y = torch.float8_e5m2\n"
        "    return torch.ops.aten._some_private_op(x), flex_attention(q, k, v)\n"
    )
    problems = unlisted(used_names(source, "x.py"))
    assert any(p.startswith("x.py:2: torch.nn.attention.flex_attention.flex_attention ") for p in problems)
    assert any(p.startswith("x.py:6: torch.float8_e5m2 ") for p in problems)
    assert any(p.startswith("x.py:7: torch.ops.aten._some_private_op ") for p in problems)
    # Listed: the keyword the drafter's attention passes is not reported.
    assert not any("enable_gqa" in p for p in problems)
    assert used_names(source, "x.py")["torch.nn.functional.scaled_dot_product_attention(enable_gqa=)"] == ["x.py:5"]
