"""The paged baseline asks the installed transformers for its API instead of assuming one release's internals: it
works on stand-ins shaped like each known release, and on transformers 5.17.0's own source where its wheel is at
hand (5.25, installed here, runs for real in test_bench_engine.py)."""
import ast
import dataclasses
import os
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers

from kvlib.cli.bench import engine_baselines
from kvlib.cli.bench.engine_baselines import PagedBatches, load_transformers, paged_cache_slots, paged_config
from kvlib.cli.bench.engine_workload import Placement, make_workload

OPTIONS = dict(num_blocks=8, max_batch_tokens=64, max_requests_per_batch=256)  # what PagedBatches passes besides


@dataclasses.dataclass
class PageSizeConfig:  # 5.25: page_size, with block_size kept as a deprecated alias
    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    block_size: int | None = None


@dataclasses.dataclass
class BlockSizeConfig:  # 5.17: block_size only
    block_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None


@dataclasses.dataclass
class UnknownConfig:
    tokens_per_block: int = 256
    num_blocks: int | None = None


def test_the_page_size_goes_under_the_name_the_release_gives_it():
    newer = paged_config(PageSizeConfig, 16, **OPTIONS)
    assert (newer.page_size, newer.block_size, newer.num_blocks) == (16, None, 8)  # not the deprecated alias
    older = paged_config(BlockSizeConfig, 16, **OPTIONS)
    assert (older.block_size, older.num_blocks) == (16, 8)


def test_a_config_with_neither_name_is_refused_naming_the_installed_release():
    with pytest.raises(TypeError, match=rf"transformers {transformers.__version__}'s UnknownConfig takes neither "
                                        r"page_size nor block_size.*install a transformers release"):
        paged_config(UnknownConfig, 16, num_blocks=8)


def test_the_slots_are_read_from_either_release_cache_layout():
    allocators = {"full_attention": SimpleNamespace(num_blocks=8, tokens_per_page=16),
                  "sliding_attention": SimpleNamespace(num_blocks=2, tokens_per_page=16)}
    assert paged_cache_slots(SimpleNamespace(cache_allocators=allocators, num_blocks=9)) == 160  # 5.25
    assert paged_cache_slots(SimpleNamespace(num_blocks=8, block_size=16, num_pages=128)) == 128  # 5.17
    assert paged_cache_slots(SimpleNamespace(num_blocks=8, num_sectors=3)) is None  # neither: not guessed
    assert paged_cache_slots(None) is None  # no cache built


def test_an_unreadable_cache_reports_the_slots_asked_for_and_says_so(checkpoint, monkeypatch):
    monkeypatch.setattr(engine_baselines, "PAGED_CACHE_LAYOUTS", ())
    placement = Placement.auto()
    model = load_transformers(checkpoint("llama-gqa"), placement)
    if not hasattr(model, "init_continuous_batching"):
        pytest.skip(f"transformers {transformers.__version__} has no paged continuous batching")
    requests = make_workload(2, 0.02, 1000.0, vocab_size=96)
    row = PagedBatches(model, 128, 4, 64, placement).serve(requests)
    assert row["KV slots"] == 128
    assert row["KV slots note"] == (f"requested, not read: transformers {transformers.__version__}'s paged cache has "
                                    f"none of the layouts kvlib knows")


WHEELS = os.environ.get("KVLIB_TRANSFORMERS_WHEELS")


def _source(wheel: Path, module: str) -> ast.Module:
    with zipfile.ZipFile(wheel) as archive:
        return ast.parse(archive.read(f"transformers/{module}.py"))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == name)


@pytest.fixture
def wheel_517():
    wheel = Path(WHEELS or ".") / "transformers-5.17.0-py3-none-any.whl"
    if not WHEELS or not wheel.is_file():
        pytest.skip(f"no {wheel.name} in KVLIB_TRANSFORMERS_WHEELS ({WHEELS or 'unset'}): run `pip download "
                    f"--no-deps transformers==5.17.0 -d DIR` and set KVLIB_TRANSFORMERS_WHEELS=DIR to check the "
                    f"adapters against that release's source")
    return wheel


def test_the_adapters_fit_transformers_5_17_source(wheel_517):
    """Its config's fields and its cache's attributes, parsed from the wheel (importing it would need its pinned
    dependencies)."""
    config = _class(_source(wheel_517, "generation/configuration_utils"), "ContinuousBatchingConfig")
    fields = [node.target.id for node in config.body if isinstance(node, ast.AnnAssign)]
    release_config = dataclasses.make_dataclass("ContinuousBatchingConfig", [(f, object, None) for f in fields])
    built = paged_config(release_config, 16, **OPTIONS)  # every option PagedBatches passes is one of its fields
    assert (built.block_size, built.num_blocks) == (16, 8)

    cache_init = _method(_class(_source(wheel_517, "generation/continuous_batching/cache"), "PagedAttentionCache"),
                         "__init__")
    attributes = {node.attr for node in ast.walk(cache_init) if isinstance(node, ast.Attribute)
                  and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id == "self"}
    cache = SimpleNamespace(**{name: 2 + k for k, name in enumerate(sorted(attributes))})
    assert paged_cache_slots(cache) == cache.num_blocks * cache.block_size

    request = _class(_source(wheel_517, "generation/continuous_batching/requests"), "RequestState")
    update = _method(request, "update_and_check_completion")  # called once per generated token
    assert "self._timestamps.append" in ast.unparse(update)  # so result.timestamps holds one time per token
