"""codemods/provenance.py: before/after cases, hit counting and idempotency."""

from __future__ import annotations

from libcst.codemod import CodemodContext, CodemodTest, TransformSuccess, transform_module

from codemods.base import BuildContext
from codemods.provenance import WriteProvenanceModule

BUILD = BuildContext(
    cell="vllm-0.9", engine="vllm", package="vllm", upstream_version="0.9.2",
    built_version="0.9.2+kvcached.3", base_artifact="vllm-0.9.2-cp38-abi3-manylinux1_x86_64.whl",
    base_sha256="f3" * 32, transform_ids=("provenance", "block-pool"), fingerprint="9a" * 32,
    toolkit_version="0.1.0",
)

EXPECTED = '''"""Which kvcached-patched vllm build this is (written at build time)."""

from __future__ import annotations

KVCACHED_BUILD_PROVENANCE = 1

CELL = "vllm-0.9"
ENGINE = "vllm"
UPSTREAM_VERSION = "0.9.2"
BUILT_VERSION = "0.9.2+kvcached.3"
BASE_ARTIFACT = "vllm-0.9.2-cp38-abi3-manylinux1_x86_64.whl"
BASE_SHA256 = "f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3"
TRANSFORMS: tuple[str, ...] = (
    "provenance",
    "block-pool",
)
PATCH_SET_FINGERPRINT = "9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a9a"
TOOLKIT_VERSION = "0.1.0"


def describe() -> dict[str, object]:
    """Which patched build this is, as plain JSON-able data."""
    return {
        "cell": CELL,
        "engine": ENGINE,
        "upstream_version": UPSTREAM_VERSION,
        "built_version": BUILT_VERSION,
        "base_artifact": BASE_ARTIFACT,
        "base_sha256": BASE_SHA256,
        "transforms": list(TRANSFORMS),
        "patch_set_fingerprint": PATCH_SET_FINGERPRINT,
        "toolkit_version": TOOLKIT_VERSION,
    }
'''


def run(source: str) -> tuple[WriteProvenanceModule, str]:
    command = WriteProvenanceModule(CodemodContext(filename="vllm/_kvcached_build.py"), BUILD)
    result = transform_module(command, source)
    assert isinstance(result, TransformSuccess)
    return command, result.code


class TestWriteProvenanceModule(CodemodTest):
    TRANSFORM = WriteProvenanceModule

    def test_absent_module_is_written(self) -> None:
        self.assertCodemod("", EXPECTED, build=BUILD)

    def test_own_output_is_left_alone(self) -> None:
        self.assertCodemod(EXPECTED, EXPECTED, build=BUILD)

    def test_upstream_file_of_that_name_is_not_overwritten(self) -> None:
        self.assertCodemod("VERSION = 1\n", "VERSION = 1\n", build=BUILD)


def test_hits_count_one_creation_and_nothing_else() -> None:
    created, code = run("")
    assert (created.hits, created.already_applied) == (1, 0)
    again, same = run(code)
    assert (again.hits, again.already_applied, same) == (0, 1, code)
    foreign, _ = run("VERSION = 1\n")
    assert (foreign.hits, foreign.already_applied) == (0, 0)


def test_describe_reports_the_build() -> None:
    namespace: dict[str, object] = {}
    exec(compile(EXPECTED, "_kvcached_build.py", "exec"), namespace)
    described = namespace["describe"]()  # type: ignore[operator]
    assert described == {
        "cell": "vllm-0.9", "engine": "vllm", "upstream_version": "0.9.2",
        "built_version": "0.9.2+kvcached.3",
        "base_artifact": "vllm-0.9.2-cp38-abi3-manylinux1_x86_64.whl",
        "base_sha256": "f3" * 32, "transforms": ["provenance", "block-pool"],
        "patch_set_fingerprint": "9a" * 32, "toolkit_version": "0.1.0",
    }
