import atexit
import faulthandler
import os
import shutil
import sys
import tempfile

from disco.platform import tune_cpu_math_env

tune_cpu_math_env()  # before torch is imported, as the CLI does

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import tiny

torch.set_num_threads(1)  # tiny models: threads only add overhead

#: pytest's exit status, kept for :func:`_exit_without_finalizing`.
EXIT_STATUS = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    """The default run (slow tests deselected) is hermetic: what the code caches under
    ``$DISCO_HOME`` (engine costs, records, converted models) goes to a temporary folder,
    which the server processes the tests start inherit, and pip cannot fetch the default
    pair. ``-m slow`` keeps the real home: those tests need the converted default pair."""
    if "not slow" in (config.getoption("markexpr") or ""):
        home = tempfile.mkdtemp(prefix="disco_home_")
        config.add_cleanup(lambda: shutil.rmtree(home, ignore_errors=True))
        os.environ["DISCO_HOME"] = home
        # No network: a test that reaches for the default pair (a command resolving
        # ``--dtype auto`` without --target/--draft) fails fast instead of fetching 1.6 GB.
        os.environ["PIP_NO_INDEX"] = "1"
        os.environ["PIP_FIND_LINKS"] = ""
    # Ray starts its workers (here: the model services' actors) at nice 15; on a shared 2-core
    # machine beside busy processes they then got a few percent of a core, and a replica took
    # minutes to load a tiny model (issue 46). The Ray runtimes the tests start (and the heads
    # `disco up` starts for them) run their workers at the tests' own priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Registered before grpc and Ray are imported: runs after their exit handlers (last in, first out).
    atexit.register(_exit_without_finalizing, config)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    # pytest's own handler is off from here: a crash in the exit handlers still says where.
    faulthandler.enable(file=sys.__stderr__, all_threads=True)


def _exit_without_finalizing(config: pytest.Config) -> None:
    """Leave with pytest's status once every exit handler has run, without tearing down the
    interpreter. Issue 46's second run of ``make test`` beside two busy processes passed every
    test (1242 passed) and then died of SIGSEGV after the summary: gRPC's and torch's native
    threads racing the interpreter's finalization over objects the tests leave to the garbage
    collector (a known gRPC Python failure under CPU load, grpc/grpc#18456). Nothing the suite
    checks happens after this point; the servers, Ray runtimes and temporary homes were
    stopped and removed by their fixtures and cleanups before."""
    status = config.stash.get(EXIT_STATUS, None)
    if status is None:  # pytest never finished a session: the normal exit
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="session")
def target_model():
    return tiny.qwen2(seed=0)


@pytest.fixture(scope="session")
def drafts(target_model):
    """Three drafts per target: unrelated random, identical, and a noisy copy."""
    return {
        "random": tiny.qwen2(seed=1, hidden=32, layers=1),
        "same": target_model,
        "noisy": tiny.noisy_copy(target_model, scale=0.02, seed=2),
    }


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory, tokenizer, target_model, drafts):
    """The tiny target and noisy draft saved as HF folders (model + tokenizer), so the
    CLI and servers can load them like any real model spec."""
    root = tmp_path_factory.mktemp("tiny_pair")
    folders = {}
    for role, model in (("target", target_model), ("draft", drafts["noisy"])):
        folder = root / role
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[role] = folder
    return folders


#: Threads the services run with by default (torch's default: one per core).
SERVICE_THREADS = os.cpu_count() or 1


def _engine_pair(tiny_pair_dirs, home, engines: dict) -> dict:
    """The tiny target and noisy draft loaded as the services load them (row plans probed,
    the packed forward proven), on ``engines[role]``, at the services' thread count."""
    from disco.config import ModelConfig  # noqa: PLC0415
    from disco.models.loading import load_model  # noqa: PLC0415

    return {role: load_model(ModelConfig(spec=str(folder), dtype=engines[role]), role, home, progress=False)
            for role, folder in tiny_pair_dirs.items()}


@pytest.fixture(scope="module", params=["int4", "int8", "bfloat16"])
def default_engine(request, tiny_pair_dirs, tmp_path_factory):
    """The tiny target and noisy draft on each engine ``--dtype auto`` may pick for the
    services on a CPU (:data:`disco.engines.engine_choice.CPU_CANDIDATES`: the target on
    int4, int8 or bf16, the draft on int4), through :func:`disco.models.loading.load_model`
    (row plans probed at load), at the services' default thread count (kernel paths depend
    on it). Yields ``{"target": LoadedModel, "draft": LoadedModel}``; the thread count is
    restored afterwards."""
    from disco.engines.engine_choice import CPU_CANDIDATES  # noqa: PLC0415

    assert request.param in CPU_CANDIDATES["target"]
    previous = torch.get_num_threads()
    torch.set_num_threads(SERVICE_THREADS)
    try:
        yield _engine_pair(tiny_pair_dirs, tmp_path_factory.mktemp("default_engine_home"),
                           {"target": request.param, "draft": CPU_CANDIDATES["draft"][0]})
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def auto_engine(tiny_pair_dirs, tmp_path_factory):
    """The tiny pair on the engines ``--dtype auto`` picks here, by timing the candidates
    (:func:`disco.engines.engine_choice.choose_engine`), at the services' thread count."""
    from disco.engines.engine_choice import choose_engine  # noqa: PLC0415

    previous = torch.get_num_threads()
    torch.set_num_threads(SERVICE_THREADS)
    home = tmp_path_factory.mktemp("auto_engine_home")
    try:
        engines = {role: choose_engine("auto", str(folder), role, "cpu", home, progress=False)
                   for role, folder in tiny_pair_dirs.items()}
        yield _engine_pair(tiny_pair_dirs, home, engines)
    finally:
        torch.set_num_threads(previous)
