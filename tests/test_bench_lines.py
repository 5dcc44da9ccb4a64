"""`zipage bench serve` reads a streamed response line by line however the network cut its bytes
(`zipage.serve.bench._lines`): for any text of lines (multi-byte characters, empty lines, a last
line without its newline, lines longer than aiohttp's own reader allows) and any cut of its
bytes into reads, the lines are the text's own."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

pytest.importorskip("aiohttp")

from zipage.serve.bench import _lines  # noqa: E402


class _Reads:
    """A response body as the reads that brought it (`iter_any` is all `_lines` asks of one)."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    async def iter_any(self):
        for read in self.reads:
            yield read


def _read_lines(reads: list[bytes]) -> list[str]:
    async def collect() -> list[str]:
        return [line async for line in _lines(_Reads(reads))]

    return asyncio.run(collect())


@st.composite
def cut_texts(draw) -> tuple[str, list[bytes]]:
    lines = draw(st.lists(st.text(alphabet=st.sampled_from("ab:{}\"é€😀 \r"), max_size=12),
                          min_size=1, max_size=8))
    text = "\n".join(lines) + draw(st.sampled_from(["", "\n"]))
    data = text.encode()
    cuts = sorted(draw(st.sets(st.integers(0, len(data)), max_size=10)))
    bounds = [0, *cuts, len(data)]
    return text, [data[start:end] for start, end in zip(bounds, bounds[1:])]


@settings(max_examples=examples(200))
@given(cut_texts())
def test_lines_are_the_texts_own_however_the_bytes_were_cut(case):
    text, reads = case
    expected = text.split("\n")
    if expected[-1] == "":  # a text ending in its newline has no line after it
        expected.pop()
    assert _read_lines(reads) == expected


def test_a_line_longer_than_aiohttps_reader_allows_is_read_whole():
    line = "data: " + "x" * (1 << 18)
    assert _read_lines([line.encode()[:1000], line.encode()[1000:] + b"\n\n"]) == [line, ""]
