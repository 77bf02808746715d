"""Run the Triton kernels under the interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when its own language library and each kernel are decorated, so the
variable must be set before triton is first imported; a conftest is loaded before the test modules
of this directory are imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
