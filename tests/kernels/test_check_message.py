"""The kernel bindings raise argument errors through ``kernels/csrc/check_message.h`` only.

On a GPU machine (torch 2.11.0+cu130, g++ 13.3) the CUDA extension carries its own
libstdc++, and TORCH_CHECK's streamed messages crashed the process there (SIGSEGV in
``std::ostream::_M_insert<long>``) at the first argument error.  That crash cannot be
reproduced with this machine's torch, whose extensions link the shared libstdc++; what can
be checked here is that no source streams a message again.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvserve.kernels import cpu_build, cuda_build

CSRC = Path(cpu_build.CSRC_DIR)
HELPER = CSRC / "check_message.h"
# Macros that format their message parts with c10::str (an std::ostringstream).
STREAMING_MACROS = re.compile(r"\b(TORCH_CHECK\w*|AT_ERROR|AT_ASSERT\w*|TORCH_INTERNAL_ASSERT\w*|c10::str)\s*\(")


def test_no_source_but_the_helper_formats_a_message_with_c10_str() -> None:
    sources = [path for path in sorted(CSRC.iterdir()) if path.suffix in {".cpp", ".cu", ".cuh", ".h"}]
    assert HELPER in sources
    offenders = {
        path.name: sorted(set(STREAMING_MACROS.findall(path.read_text())))
        for path in sources
        if path != HELPER and STREAMING_MACROS.search(path.read_text())
    }
    assert offenders == {}


def test_both_bindings_use_the_helper_and_rebuild_when_it_changes() -> None:
    for binding in ("paged_attention_cpu.cpp", "paged_attention_cuda_binding.cpp"):
        assert '#include "check_message.h"' in (CSRC / binding).read_text()
    assert HELPER in cpu_build.HEADERS
    assert HELPER in cuda_build.HEADERS
