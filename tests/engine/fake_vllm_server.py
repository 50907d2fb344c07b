"""A small stand-in for a vLLM server running our connector: a real process on a real port that writes feature
files the way our connector does (``dflash_flow.engine.handover.FeatureWriter``).

    python fake_vllm_server.py --port-file F --dir D --layers 2,6 --hidden 16 [--behaviour B] [--target PRESET]

``GET /v1/models`` lists ``--model`` with ``--max-model-len``; ``POST /v1/completions`` takes token ids
(``prompt``), writes ``token_ids [S]`` and ``hidden_states [S, n, H]`` to ``D/<request id>.safetensors`` and
answers with ``kv_transfer_params.hidden_states_path``. The features are :func:`synthetic_features` of the
token ids, or with ``--target`` a real target's ``hidden_states[k]`` for each vLLM id k (a preset, built
here in fp32).

``--behaviour``: ``ok``; ``zeros`` (the second layer all zero), ``nan`` (one NaN), ``wrong-ids`` (the
file's last token id changed), ``layer-count`` (one layer too many), ``no-path`` (no kv_transfer_params),
``outside`` (a path outside the directory), ``repeat`` (the second layer equal to the first), ``no-file`` (answers, never writes), ``off-by-one`` (with
``--target``: vLLM ids minus one, i.e. our ids unmapped), ``slow:S`` (sleeps S seconds before answering),
``die-after:N`` (answers N requests, then exits mid-request on the next one), ``bf16`` (features in bfloat16).
Each request is appended to ``--log`` as ``{"n": count, "len": tokens}`` when it arrives. ``POST /control``
``{"behaviour": B, "dir": D}`` switches a running server's behaviour and directory (and restarts its count).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def synthetic_features(ids: list[int], engine_layers: list[int], hidden: int):
    """Deterministic, never zero: ``[S, n, H]`` from the token ids, positions and layer ids."""
    import torch

    t = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    pos = torch.arange(len(ids), dtype=torch.float32)[:, None, None]
    layer = torch.tensor(engine_layers, dtype=torch.float32)[None, :, None]
    h = torch.arange(hidden, dtype=torch.float32)[None, None, :]
    return 1.5 + torch.sin(t * 0.01 + pos * 0.1 + layer + h * 0.3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", default=None)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layers", required=True, help="vLLM layer ids, comma separated")
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--model", default="target")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--behaviour", default="ok")
    ap.add_argument("--target", default=None)
    ap.add_argument("--log", default=None)
    ap.add_argument("--pid-file", default=None)
    args = ap.parse_args()
    import torch

    from dflash_flow.engine.handover import FeatureWriter, feature_file_name

    layers = [int(x) for x in args.layers.split(",")]
    state = {"behaviour": args.behaviour, "dir": args.dir}
    writer = FeatureWriter(args.dir)
    lock = threading.Lock()
    count = [0]
    model = None
    if args.target:
        from dflash_flow.model.target import load_target

        torch.set_num_threads(1)
        model = load_target(args.target, dtype=torch.float32)
    log = open(args.log, "a") if args.log else None

    def features(ids: list[int], mode: str):
        if model is None:
            return synthetic_features(ids, layers, args.hidden)
        with torch.inference_mode():
            hs = model.model(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True).hidden_states
        chosen = [k - 1 for k in layers] if mode == "off-by-one" else layers
        return torch.stack([hs[k][0] for k in chosen], dim=1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, status: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": args.model, "max_model_len": args.max_model_len}]})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path == "/control":  # the tests switch a running server's behaviour
                with lock:
                    state["behaviour"] = payload["behaviour"]
                    state["dir"] = payload.get("dir", state["dir"])
                    count[0] = 0
                self._send(200, {"behaviour": state["behaviour"]})
                return
            mode, _, arg = state["behaviour"].partition(":")
            directory = state["dir"]  # where this request's file goes, whatever the next test sets
            if self.path != "/v1/completions":
                self._send(404, {"error": "not found"})
                return
            ids = [int(x) for x in payload["prompt"]]
            with lock:
                count[0] += 1
                n = count[0]
                if log is not None:
                    log.write(json.dumps({"n": n, "len": len(ids)}) + "\n")
                    log.flush()
            if mode == "die-after" and n > int(arg):
                os._exit(3)  # mid-request: the connection drops without an answer
            if payload.get("model") != args.model:
                self._send(404, {"error": f"model {payload.get('model')} not served"})
                return
            if len(ids) >= args.max_model_len:
                self._send(400, {"error": f"{len(ids)} tokens: longer than the maximum context length"})
                return
            if mode == "slow":
                time.sleep(float(arg))
            feats = features(ids, mode)
            file_ids = list(ids)
            if mode == "zeros":
                feats[:, 1, :] = 0
            elif mode == "nan":
                feats[len(ids) // 2, 0, 3] = float("nan")
            elif mode == "wrong-ids":
                file_ids[-1] += 1
            elif mode == "repeat":
                feats[:, 1, :] = feats[:, 0, :]
            elif mode == "layer-count":
                feats = torch.cat([feats, feats[:, :1]], dim=1)
            elif mode == "bf16":
                feats = feats.to(torch.bfloat16)
            req_id = f"cmpl-{os.getpid()}-{n}"
            path = os.path.join(directory, feature_file_name(req_id))
            if mode == "outside":
                path = str(Path(directory).parent / f"{req_id}.safetensors")
            if mode != "no-file":
                writer.submit(path, feats.contiguous(), file_ids)
            reply = {"id": req_id, "object": "text_completion", "model": args.model,
                     "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}}
            if mode != "no-path":
                reply["kv_transfer_params"] = {"hidden_states_path": path}
            self._send(200, reply)

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    if args.pid_file:
        Path(args.pid_file).write_text(str(os.getpid()))
    if args.port_file:
        tmp = args.port_file + ".tmp"
        Path(tmp).write_text(str(server.server_address[1]))
        os.replace(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
