"""Layout geometry: block bytes, shapes, strides, page tiling, and views over real tensors."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.layout import (
    check_page_geometry,
    compound_page_bytes,
    nearest_working_block_bytes,
    page_byte_offset,
)
from tests.unit.backend_views import (
    KVCacheSpec,
    KVLayout,
    block_byte_offset,
    block_bytes,
    kernel_block_byte_offset,
    layer_view_geometry,
)

KIB = 1024
MIB = 1 << 20


def test_layout_module_does_not_import_torch_at_import_time() -> None:
    import subprocess

    code = "import sys, kvcached_core.layout; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_block_bytes_formula() -> None:
    assert block_bytes(16, 8, 128, 2) == 16 * 8 * 128 * 2
    assert block_bytes(16, 8, 128, 2, packed=True) == 2 * 16 * 8 * 128 * 2
    spec = KVCacheSpec(KVLayout.FLASH_ATTN, 16, 8, 128, 2)
    assert spec.block_bytes == 32 * KIB
    assert spec.num_kv_buffers == 2
    assert KVCacheSpec(KVLayout.MLA, 64, 1, 576, 2).block_bytes == 64 * 576 * 2
    assert KVCacheSpec(KVLayout.MLA, 64, 1, 576, 2).num_kv_buffers == 1
    assert KVCacheSpec(KVLayout.PACKED, 16, 4, 64, 2).block_bytes == 16 * 4 * 128 * 2


def test_page_geometry_both_directions() -> None:
    tiled = check_page_geometry(32 * KIB, 2 * MIB)
    assert (tiled.blocks_per_page, tiled.pages_per_block, tiled.ledger_page_bytes) == (
        64,
        1,
        2 * MIB,
    )
    spanning = check_page_geometry(6 * MIB, 2 * MIB)
    assert (spanning.blocks_per_page, spanning.pages_per_block) == (1, 3)
    assert spanning.ledger_page_bytes == 6 * MIB


def test_page_geometry_error_names_both_numbers_and_a_fix() -> None:
    with pytest.raises(KVCachedConfigError) as info:
        check_page_geometry(24 * KIB, 2 * MIB)
    message = str(info.value)
    assert "24576" in message and "2097152" in message
    assert "nearest working block size: 32768" in message
    with pytest.raises(KVCachedConfigError, match=r"8192 bytes \(16 tokens of 512 bytes\)"):
        check_page_geometry(20 * 512, 2 * MIB, token_bytes=512)


def test_nearest_working_block_bytes() -> None:
    assert nearest_working_block_bytes(24 * KIB, 64 * KIB) == 32 * KIB
    assert nearest_working_block_bytes(5 * MIB, 2 * MIB) == 4 * MIB
    assert nearest_working_block_bytes(3 * MIB + 1, 2 * MIB) == 4 * MIB
    for size in (1000, 5000, 70000, 3 * MIB):
        good = nearest_working_block_bytes(size, 2 * MIB)
        assert (2 * MIB) % good == 0 or good % (2 * MIB) == 0


def test_kernel_block_split_must_divide() -> None:
    spec = KVCacheSpec(KVLayout.FLASH_ATTN, 256, 2, 64, 2, kernel_block_size=64)
    assert spec.kernel_blocks_per_block == 4
    assert spec.kernel_block_bytes * 4 == spec.block_bytes
    with pytest.raises(KVCachedConfigError, match="must divide"):
        KVCacheSpec(KVLayout.FLASH_ATTN, 256, 2, 64, 2, kernel_block_size=48)
    with pytest.raises(KVCachedConfigError, match="num_kv_heads must be 1"):
        KVCacheSpec(KVLayout.MLA, 16, 2, 64, 2)


def test_contiguous_page_offsets() -> None:
    assert compound_page_bytes(2 * MIB, 32, 2) == 128 * MIB
    assert page_byte_offset(3, 2 * MIB, num_layers=32, num_kv_buffers=2, contiguous=True) == (
        3 * 128 * MIB
    )
    assert page_byte_offset(3, 2 * MIB, num_layers=32, num_kv_buffers=2, contiguous=False) == (
        6 * MIB
    )


def test_contiguous_compound_page_holds_whole_blocks_of_every_layer() -> None:
    # Every byte of block b (all layers, all buffers) lies in compound page b // blocks_per_page.
    spec = KVCacheSpec(KVLayout.FLASH_ATTN, 16, 2, 32, 2, kernel_block_size=4)
    page_size, layers = 8 * spec.block_bytes, 3
    compound = compound_page_bytes(page_size, layers, spec.num_kv_buffers)
    for block, layer, buffer in itertools.product(range(24), range(layers), range(2)):
        start = block_byte_offset(
            spec,
            block=block,
            layer=layer,
            buffer=buffer,
            num_layers=layers,
            region_bytes=0,
            contiguous=True,
        )
        for kernel in range(spec.kernel_blocks_per_block):
            offset = kernel_block_byte_offset(
                spec,
                kernel_block=block * 4 + kernel,
                layer=layer,
                buffer=buffer,
                num_layers=layers,
                region_bytes=0,
                contiguous=True,
            )
            assert offset // compound == block // 8
            assert (offset + spec.kernel_block_bytes - 1) // compound == block // 8
        assert start // compound == block // 8


EXPECTED_SHAPES = {
    KVLayout.FLASH_ATTN: lambda nb, t, h, d: (2, nb, t, h, d),
    KVLayout.FLASHINFER: lambda nb, t, h, d: (nb, 2, t, h, d),
    KVLayout.PACKED: lambda nb, t, h, d: (nb, h, t, 2 * d),
    KVLayout.MLA: lambda nb, t, h, d: (nb, t, d),
    KVLayout.CPU: lambda nb, t, h, d: (2, nb, h, t, d),
}


def _spec(layout: KVLayout, kernel: int | None) -> KVCacheSpec:
    heads = 1 if layout is KVLayout.MLA else 2
    return KVCacheSpec(layout, 8, heads, 4, 2, kernel_block_size=kernel)


def _block_index(layout: KVLayout, view: torch.Tensor, buffer: int, block: int) -> torch.Tensor:
    if layout in (KVLayout.FLASH_ATTN, KVLayout.CPU):
        return view[buffer, block]
    if layout is KVLayout.FLASHINFER:
        return view[block, buffer]
    if layout is KVLayout.PACKED:
        half = view.shape[-1] // 2
        return view[block, :, :, buffer * half : (buffer + 1) * half]
    return view[block]


@pytest.mark.parametrize("contiguous", [False, True], ids=["per-layer", "contiguous"])
@pytest.mark.parametrize("kernel", [None, 2], ids=["whole", "split"])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_view_geometry_over_plain_buffer(
    layout: KVLayout, kernel: int | None, contiguous: bool
) -> None:
    """Strided views of a flat buffer put every kernel block where the layout promises."""
    spec = _spec(layout, kernel)
    layers, blocks = 3, 6
    region = blocks * spec.block_bytes
    buffers = spec.num_kv_buffers
    flats = (
        [torch.zeros(region * layers * buffers, dtype=torch.uint8)]
        if contiguous
        else [torch.zeros(region * buffers, dtype=torch.uint8) for _ in range(layers)]
    )
    kernel_blocks = blocks * spec.kernel_blocks_per_block
    for layer in range(layers):
        geometry = layer_view_geometry(
            spec, layer=layer, num_layers=layers, region_bytes=region, contiguous=contiguous
        )
        assert geometry.shape == EXPECTED_SHAPES[layout](
            kernel_blocks, spec.kernel_block_tokens, spec.num_kv_heads, spec.head_size
        )
        flat = flats[0] if contiguous else flats[layer]
        view = torch.as_strided(
            flat.view(torch.float16), geometry.shape, geometry.strides, geometry.storage_offset
        )
        for buffer, unit in itertools.product(
            range(buffers if layout is not KVLayout.PACKED else 2), range(kernel_blocks)
        ):
            flat.zero_()
            _block_index(layout, view, buffer, unit).fill_(1.0)
            touched = flat.view(torch.float16).nonzero().flatten() * 2
            if layout is KVLayout.PACKED:
                # K and V share one buffer: the whole written slice lies inside the unit.
                start = kernel_block_byte_offset(
                    spec,
                    kernel_block=unit,
                    layer=layer,
                    buffer=0,
                    num_layers=layers,
                    region_bytes=region,
                    contiguous=contiguous,
                )
            else:
                start = kernel_block_byte_offset(
                    spec,
                    kernel_block=unit,
                    layer=layer,
                    buffer=buffer,
                    num_layers=layers,
                    region_bytes=region,
                    contiguous=contiguous,
                )
            assert int(touched.min()) >= start
            assert int(touched.max()) < start + spec.kernel_block_bytes
            if layout is not KVLayout.PACKED:
                assert len(touched) * 2 == spec.kernel_block_bytes


def test_layer_out_of_range_is_rejected() -> None:
    spec = _spec(KVLayout.FLASH_ATTN, None)
    with pytest.raises(KVCachedConfigError, match="layer 3 out of range"):
        layer_view_geometry(
            spec, layer=3, num_layers=3, region_bytes=spec.block_bytes, contiguous=False
        )
    with pytest.raises(KVCachedConfigError, match="not a multiple of the block size"):
        layer_view_geometry(
            spec, layer=0, num_layers=3, region_bytes=spec.block_bytes + 2, contiguous=False
        )
