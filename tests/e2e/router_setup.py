"""How the router's proofs run each engine kind on this machine's CPU (tests/e2e/test_router.py,
benchmarks/bench_router.py): the arguments and environment a `router.yaml` gives each model."""

from __future__ import annotations

from tests.sglang.envs import SHIMS

VLLM_ARGS = ["--max-model-len", "512", "--block-size", "32", "--enforce-eager",
             "--distributed-executor-backend", "uni", "--kv-cache-memory-bytes", "16M",
             "--shutdown-timeout", "10"]
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "KVCACHED_PAGE_SIZE": "16K", "KVCACHED_MIN_RESERVED_PAGES": "0",
            "KVCACHED_MAX_RESERVED_PAGES": "2"}
SGLANG_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
               "--max-total-tokens", "4096", "--skip-server-warmup", "--random-seed", "0"]
SGLANG_ENV = {"PYTHONPATH": str(SHIMS), "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1",
              "KVCACHED_PAGE_SIZE": "4K", "KVCACHED_MIN_RESERVED_PAGES": "0",
              "KVCACHED_MAX_RESERVED_PAGES": "2"}
