"""The Python distributions the lent GPU machine's image ('cuda', nvidia-h200) holds, as read
on a machine running it on 2026-11-17 (the device tool's list). bench.gpu_kit carries the rest.
Names as pip writes them; compare with `canonical` (PEP 503)."""

from __future__ import annotations

import re

_IMAGE = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
    meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
    narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
    pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
    scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
    sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels
    sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
    tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
    urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


IMAGE = frozenset(canonical(n) for n in _IMAGE.split())
