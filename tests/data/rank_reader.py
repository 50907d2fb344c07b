"""One 'rank' reading an input into a shared cache (run as a subprocess by the store tests): waits for
the start time, reads, prints what happened as JSON."""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import time

from dflash_flow.data.records import ReadOptions, read_records


def main() -> None:
    path, cache, start_at = sys.argv[1], sys.argv[2], float(sys.argv[3])
    while time.time() < start_at:
        time.sleep(0.005)
    states = []
    t0 = resource.getrusage(resource.RUSAGE_SELF)
    tf = read_records(path, options=ReadOptions(cache_dir=cache, num_workers=0), kind="tokens",
                      progress=lambda p: states.append(p.state))
    t1 = resource.getrusage(resource.RUSAGE_SELF)
    digest = hashlib.sha256(bytes(tf.ids) + bytes(tf.mask) + bytes(tf.offsets) + bytes(tf.lines)).hexdigest()
    print(json.dumps({"built": not tf.report.from_cache, "states": sorted(set(states)), "digest": digest,
                      "cpu_s": (t1.ru_utime + t1.ru_stime) - (t0.ru_utime + t0.ru_stime)}))


if __name__ == "__main__":
    main()
