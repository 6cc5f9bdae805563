"""What instruction set torch's CPU libraries pick in this environment; runs under any venv's
Python (tinyllm's, vLLM's), never imports tinyllm. Prints one JSON object on stdout:
``torch_cpu_capability`` (ATen's kernels, ``ATEN_CPU_CAPABILITY``), ``onednn_isa`` (what oneDNN
reports with ``ONEDNN_VERBOSE=1`` when a convolution creates its first primitive,
``ONEDNN_MAX_CPU_ISA``), ``mkl_isa`` (the processors MKL says its code path is for with ``MKL_VERBOSE=1`` on an f32 matmul,
``MKL_ENABLE_INSTRUCTIONS``); null where the library said nothing. The caller sets the
environment; the verbose output of the libraries is read back from this process's own stdout,
so the probe re-runs itself as a child with both verbose switches on.
"""

import json
import os
import re
import subprocess
import sys


def child() -> None:
    import torch
    torch.set_num_threads(1)
    torch.nn.functional.linear(torch.randn(64, 256), torch.randn(256, 256))  # MKL sgemm
    torch.ops.aten.mkldnn_convolution(torch.randn(1, 8, 16, 16), torch.randn(8, 8, 3, 3), None,
                                      [0, 0], [1, 1], [1, 1], 1)  # oneDNN
    print("@@CAP " + torch.backends.cpu.get_cpu_capability(), flush=True)


def main() -> None:
    env = os.environ | {"ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"}
    out = subprocess.run([sys.executable, __file__, "child"], capture_output=True, text=True, env=env,
                         timeout=600).stdout
    cap = re.search(r"^@@CAP (\S+)", out, re.M)
    onednn = re.search(r"onednn_verbose,.*?info,cpu,isa:([^\n,]+)", out)
    mkl = re.search(r"^MKL_VERBOSE oneMKL [^\n]*? for ([^\n]*?processors)", out, re.M)
    print(json.dumps({"torch_cpu_capability": cap.group(1) if cap else None,
                      "onednn_isa": onednn.group(1).strip() if onednn else None,
                      "mkl_isa": mkl.group(1).strip() if mkl else None}))


if __name__ == "__main__":
    child() if sys.argv[1:] == ["child"] else main()
