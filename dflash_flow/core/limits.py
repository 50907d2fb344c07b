"""How much work a pipeline definition may ask for, each checked where the work would happen (a hostile file is
refused in milliseconds); generous for real pipelines (a few kilobytes, a nesting of 6, a few dozen replicas)."""

from __future__ import annotations

#: Largest pipeline file (and largest ``--set`` value) read, in bytes.
MAX_YAML_BYTES = 256 * 1024
#: Deepest nesting of lists and mappings in a document, counted after aliases are expanded.
MAX_YAML_DEPTH = 64
#: Most nodes a document may stand for once every alias is expanded (stops alias and merge-key bombs).
MAX_YAML_NODES = 20_000
#: Longest number literal: YAML 1.1's base-60 integers (``1:30:00``) cost quadratic time in their length.
MAX_NUMBER_CHARS = 100

#: Replicas of one stage: every replica is a thread (and often a model copy).
MAX_REPLICAS = 1024
#: Replicas of the whole pipeline together (threads of one process).
MAX_TOTAL_REPLICAS = 4096
#: Items one input queue may buffer (runtime.capacity and a stage's capacity).
MAX_CAPACITY = 65_536
#: A seed must fit the 64-bit seeding of numpy, torch and Python's random.
MAX_SEED = 2**63 - 1
#: Longest runtime wait (timeouts, intervals) in seconds, ~31 years: Python's waits overflow near 1e10.
MAX_SECONDS = 10**9
#: Longest pipeline or stage name: names become thread names, MLflow keys and file names.
MAX_NAME_CHARS = 100
