"""One code space for the kernels' data formats: the C header and the Python
table hold the same numbers, and weights and KV rows never share a code."""
import re
from pathlib import Path

import trajserve.model as model_pkg
from trajserve.model.formats import CODES
from trajserve.model.kv_quant import FORMATS

HEADER = Path(model_pkg.__file__).parent / "formats.h"
NAMES = {"TS_F32": "float32", "TS_BF16": "bfloat16", "TS_Q8_0": "q8_0", "TS_Q4_0": "q4_0", "TS_Q4_1": "q4_1", "TS_Q4_K": "q4_k", "TS_Q6_K": "q6_k",
         "TS_Q5_K": "q5_k", "TS_MXFP4": "mxfp4"}


def test_header_and_table_agree():
    enum = re.search(r"enum\s*\{([^}]*)\}", HEADER.read_text()).group(1)
    in_c = {NAMES[n]: int(v) for n, v in re.findall(r"(TS_\w+)\s*=\s*(\d+)", enum)}
    assert in_c == CODES
    assert len(set(CODES.values())) == len(CODES)


def test_kv_formats_take_their_codes_from_the_table():
    assert {f.name: f.code for f in FORMATS.values()} == {n: CODES[n] for n in FORMATS}


def test_no_other_code_space_in_the_kernels():
    """No second enum of format codes in the C sources."""
    for src in HEADER.parent.glob("*.[ch]"):
        if src.name != "formats.h":
            assert not re.search(r"enum\s*\{[^}]*(Q8_0|Q4_0|F32)\s*=", src.read_text()), src.name
