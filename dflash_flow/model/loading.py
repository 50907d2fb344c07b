"""One lock for building and loading models in a multi-threaded process.

transformers (and torch's meta-device helpers) patch process-wide state while they build a model, so two
stage replicas loading models at the same time on different threads can see each other's half-built
modules ("Cannot copy out of meta tensor"). Every stage that builds or loads a model holds this lock for
that part of its setup; forward and backward passes run concurrently as usual.
"""

from __future__ import annotations

import threading

MODEL_LOAD_LOCK = threading.RLock()
