"""``import trainfold`` is lazy: it loads neither torch nor any layer, and every public name still resolves
(``tests/test_public_names.py``) on first use. ``benchmarks/import_time.py`` measures what that buys."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import trainfold


def loaded_after(code: str) -> list[str]:
    """The modules of interest a fresh interpreter holds after running ``code``."""
    probe = f"{code}; import json, sys; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [m for m in json.loads(done.stdout) if m.split(".")[0] in ("trainfold", "torch", "fcntl", "transformers")]


def test_import_trainfold_loads_no_layer_and_not_torch():
    assert loaded_after("import trainfold") == ["trainfold"]


def test_the_version_is_read_from_the_package_metadata_when_asked():
    probe = "import sys, trainfold; print('importlib.metadata' in sys.modules, trainfold.__version__)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    from trainfold.core.version import library_version

    assert done.stdout.split() == ["False", library_version()]  # importlib.metadata: ~0.1-0.3 s, paid on use


def test_import_trainfold_works_where_posix_only_modules_do_not_exist():
    loaded = loaded_after("import sys; sys.modules['fcntl'] = None; import trainfold; trainfold.__version__")
    assert "trainfold" in loaded


def test_the_functional_core_does_not_load_the_hf_layer_or_transformers():
    loaded = loaded_after("from trainfold import TrainState, adamw, fit, init_state, make_step, stream")
    assert [m for m in loaded if m.startswith(("trainfold.trainer", "trainfold.loop", "transformers"))] == []


def test_a_lazy_name_is_the_owning_modules_object_and_is_kept():
    from trainfold.ckpt import reader

    assert trainfold.load is reader.load
    assert "load" in vars(trainfold)  # the second lookup is a plain attribute


def test_star_import_and_dir_offer_every_public_name():
    namespace: dict[str, object] = {}
    exec("from trainfold import *", namespace)
    assert set(trainfold.__all__) <= set(namespace) and set(trainfold.__all__) <= set(dir(trainfold))


def test_an_unknown_name_is_an_attribute_error_naming_the_public_names():
    with pytest.raises(AttributeError, match=r"no attribute 'trian'.*trainfold.__all__"):
        trainfold.trian  # noqa: B018


def test_the_package_ships_its_type_information_marker():
    import importlib.resources

    assert importlib.resources.files("trainfold").joinpath("py.typed").is_file()


def test_train_loads_neither_dtensor_nor_transformers_until_a_run_needs_them():
    """``torch.distributed.tensor`` (FSDP's DTensor, ~1 s with sympy) is imported by a sharded run alone."""
    loaded = loaded_after("from trainfold import train")
    assert "trainfold.trainer.train" in loaded
    assert [
        m for m in loaded if m.startswith(("torch.distributed.tensor", "transformers", "trainfold.step.sharded"))
    ] == []
