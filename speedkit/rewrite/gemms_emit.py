"""batched's decisions and emitter: per instance, whether each site found by
:mod:`speedkit.rewrite.gemms` is rewritten (plain ``nn.Linear`` without hooks, of one input width,
dtype and device; ensemble members identical in structure, parameters and attributes, with no
running statistics or dropout), and the rewrite into :mod:`speedkit.kernels.ops`' batched calls.
"""

from __future__ import annotations

import ast
import builtins
import os
from typing import Any

import torch
from torch import nn

from speedkit.rewrite.ast_tools import Replace, call_ops, global_value, name_node, names_stored, self_attr, short
from speedkit.rewrite.gemms import Finder, Site, find
from speedkit.rewrite.pipeline import Decided, Found, Rewriter
from speedkit.rewrite.source import ParsedMethod, parse_function


def _at(parsed: ParsedMethod, line: int) -> str:
    return f"{parsed.cls.__name__} ({os.path.basename(parsed.filename)}:{line})"


def _hook_reason(module: nn.Module) -> str | None:
    for kind in ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks"):
        if getattr(module, f"_{kind}", None):
            return f"has {kind.replace('_', ' ')[:-1]}"
    if "forward" in module.__dict__:
        return "has an instance-level forward"
    return None


def _linear_reason(module: Any, label: str) -> str | None:
    if type(module) is not nn.Linear:
        return f"{label} is a {type(module).__name__}, not an nn.Linear"
    reason = _hook_reason(module)
    return f"{label} {reason}" if reason else None


def _linear_key(lin: nn.Linear) -> tuple:
    return lin.in_features, lin.weight.dtype, lin.weight.device, lin.bias is not None


def _key_difference(key: tuple, other: tuple) -> str:
    for name, mine, theirs in zip(("in_features", "dtype", "device"), key, other):
        if mine != theirs:
            return f"{name} {mine} where the others have {theirs}"
    return "no bias where the others have one" if not key[3] else "a bias where the others have none"


def _ensemble_reason(members: list[nn.Module]) -> str | None:
    """Why vmap over stacked weights of ``members`` would not compute what calling each does."""
    internals = set(nn.Module().__dict__) | {"training"}
    base = members[0]

    def signature(m: nn.Module) -> tuple:
        return (
            [(n, type(s)) for n, s in m.named_modules()],
            [(n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in m.named_parameters()],
            [(n, b.shape, b.dtype, b.device) for n, b in m.named_buffers()],
        )

    wanted = signature(base)
    for k, m in enumerate(members):
        if type(m) is not type(base) or signature(m) != wanted:
            return f"member {k} differs from member 0 in structure, parameter or buffer shapes"
        for name, sub in m.named_modules():
            label = f"member {k}{'.' + name if name else ''}"
            reason = _hook_reason(sub)
            if reason:
                return f"{label} {reason}"
            if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats:
                return f"{label} keeps running statistics (updated in place per member)"
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
                return f"{label} uses dropout (random masks would differ from the loop's)"
            twin = base.get_submodule(name)
            for key, value in vars(sub).items():
                if key in internals:
                    continue
                other = vars(twin).get(key)
                same = value is other or (
                    isinstance(value, (int, float, str, bool, type(None), tuple, list))
                    and type(value) is type(other)
                    and value == other
                )
                if not same:
                    return f"{label}.{key} differs from member 0's"
    return None


def _module_list(module: nn.Module, attr: str) -> nn.ModuleList | None:
    value = getattr(module, attr, None)
    return value if isinstance(value, nn.ModuleList) else None


def decide(
    module: nn.Module, parsed: ParsedMethod, found: Found, linears: bool = True, loops: bool = True, ensembles: bool = True
) -> Decided:
    """Per site of the method: the decision for this instance (None = left alone), what it does, and
    near misses; ``linears``, ``loops``, ``ensembles``: the forms the rung may rewrite."""
    decisions: list[Any] = []
    done: list[str] = []
    notes: list[str] = []
    taken_over: list[nn.Module] = []

    def skip(site: Site, reason: str) -> None:
        decisions.append(None)
        notes.append(f"{_at(parsed, site.line)}: {reason}")

    for note in found.notes:
        if note.needs_linears is not None:
            lst = _module_list(module, note.needs_linears)
            if lst is None or not len(lst) or not all(isinstance(m, nn.Linear) for m in lst):
                continue
        if note.needs_linear_attrs and sum(isinstance(getattr(module, a, None), nn.Linear) for a in note.needs_linear_attrs) < 2:
            continue
        notes.append(f"{_at(parsed, note.line)}: {note.reason}")
    arguments = {a.arg for a in ast.walk(parsed.tree.args) if isinstance(a, ast.arg)}
    for site in found.sites:
        shadowed = [n for n in site.torch_names if global_value(parsed.function, n) is not torch] + [
            n for n in site.builtin_names if global_value(parsed.function, n) is not getattr(builtins, n)
        ]
        local = (site.torch_names | site.builtin_names) & (names_stored(parsed.tree) | arguments)
        if shadowed or local:
            skip(site, f"`{sorted(set(shadowed) | local)[0]}` does not refer to what it seems")
        elif site.kind == "siblings":
            if not linears:
                decisions.append(None)
                continue
            # other modules called on the same input (norms, dropout, blocks) are no candidates at all
            mods = [getattr(module, attr, None) for attr, _, _ in site.members]
            linear_members = [j for j, m in enumerate(mods) if isinstance(m, nn.Linear)]
            if len(linear_members) < 2:
                decisions.append(None)
                continue
            by_key: dict[tuple, list[int]] = {}
            for j in linear_members:
                reason = _linear_reason(mods[j], f"self.{site.members[j][0]}")
                if reason:
                    notes.append(
                        f"{_at(parsed, site.members[j][2].lineno)}: not fused with its siblings on {site.input}: {reason}"
                    )
                else:
                    by_key.setdefault(_linear_key(mods[j]), []).append(j)
            fused = tuple(tuple(js) for js in by_key.values() if len(js) > 1)
            common = max(by_key, key=lambda key: len(by_key[key])) if by_key else None
            for key, js in by_key.items():
                if len(js) == 1 and len(by_key) > 1:
                    j = js[0]
                    notes.append(
                        f"{_at(parsed, site.members[j][2].lineno)}: self.{site.members[j][0]} not fused with its "
                        f"siblings on {site.input}: {_key_difference(key, common)}"
                    )
            decisions.append(fused or None)
            done += [f"fused {','.join(site.members[j][0] for j in js)} Linear" for js in fused]
        elif site.kind == "list":
            lst = _module_list(module, site.attr)
            if lst is None:
                skip(site, f"self.{site.attr} is not an nn.ModuleList")
            elif len(lst) < 2:
                skip(site, f"self.{site.attr} holds {len(lst)} module(s): nothing to batch")
            elif (
                len(site.args) == 1
                and all(type(m) is nn.Linear for m in lst)
                and not any(_linear_reason(m, "") for m in lst)
                and len({_linear_key(m) for m in lst}) == 1
            ):
                if linears:
                    decisions.append("linear")
                    done.append(f"fused {len(lst)} Linears of self.{site.attr}")
                else:
                    decisions.append(None)
            elif not ensembles:
                decisions.append(None)
            else:
                reason = _ensemble_reason(list(lst))
                if reason:
                    skip(site, f"self.{site.attr}: {reason}")
                else:
                    decisions.append("ensemble")
                    taken_over += list(lst.modules())  # members run inside vmap through the base's own forward
                    done.append(f"vmapped ensemble self.{site.attr} of {len(lst)} {type(lst[0]).__name__}")
        elif site.kind == "loop":
            if not loops:
                decisions.append(None)
                continue
            what = f"{'stacked ' if site.form == 'stack' else ''}loop over range({short(site.count, 24)})"  # type: ignore[arg-type]
            if site.op == "linear":
                lst = _module_list(module, site.attr)
                reasons = [r for k, m in enumerate(lst or []) if (r := _linear_reason(m, f"self.{site.attr}[{k}]"))]
                if lst is None or not any(isinstance(m, nn.Linear) for m in lst):
                    decisions.append(None)  # a list of other modules (blocks, convs): no Linear candidate
                elif reasons:
                    skip(site, reasons[0])
                elif len({(_linear_key(m), m.out_features) for m in lst}) != 1:
                    skip(site, f"the Linears of self.{site.attr} differ in shape, dtype, device or bias")
                else:
                    decisions.append("loop")
                    done.append(f"{what} of self.{site.attr}[i] Linear → one batched GEMM")
            else:
                decisions.append("loop")
                done.append(f"{what} of matmuls → one batched matmul")
    # an instance already rewritten by another rung was analysed on that rewrite (rewrites stack);
    # a compiled or patched forward never gets here (parse_instance_method refuses it)
    return Decided(tuple(decisions), done, notes, taken_over)


def emit(parsed: ParsedMethod, tree: ast.FunctionDef, decisions: tuple[Any, ...]) -> None:
    """Rewrite ``tree`` (a fresh copy of ``parsed.tree``) in place: the sites found in it, as decided."""
    self_name = parsed.self_name
    sites = Finder(tree, self_name).run().sites  # same walk, same order: site k of the copy is site k
    replace: dict[int, ast.expr] = {}
    for k, (site, decision) in enumerate(zip(sites, decisions)):
        if decision is None:
            continue
        if site.kind == "siblings":
            for g, group in enumerate(decision):
                members = [site.members[j] for j in group]
                temps = [f"__sk_lin_{k}_{g}_{j}" for j in range(len(members))]
                first = min((st for _, _, st in members), key=site.block.index)
                linears = ast.Tuple(elts=[self_attr(self_name, a) for a, _, _ in members], ctx=ast.Load())
                fused = ast.Assign(
                    targets=[ast.Tuple(elts=[name_node(t, True) for t in temps], ctx=ast.Store())],
                    value=call_ops("fused_linear", name_node(site.input), linears),
                )
                site.block.insert(site.block.index(first), ast.copy_location(fused, first))
                replace.update({id(call): name_node(t) for t, (_, call, _) in zip(temps, members)})
        elif site.kind == "list":
            lst = site.node.generators[0].iter  # type: ignore[union-attr]
            if decision == "linear":  # a list display, not list(...): the user's globals may shadow builtins
                new: ast.expr = ast.List(
                    elts=[ast.Starred(value=call_ops("fused_linear", site.args[0], lst), ctx=ast.Load())], ctx=ast.Load()
                )
            else:
                new = call_ops("ensemble", lst, *site.args)
            replace[id(site.node)] = new
        else:
            n = f"__sk_n_{k}"
            if site.op == "matmul":
                (a, a_idx), (b, b_idx) = site.operands
                batched = call_ops("loop_matmul", a, b, name_node(n), ast.Constant(a_idx), ast.Constant(b_idx))
            else:
                ((x, x_idx),) = site.operands
                layers = self_attr(self_name, site.attr)
                batched = call_ops("loop_linear", layers, x, name_node(n), ast.Constant(x_idx))
            stmts: list[ast.stmt] = [ast.Assign(targets=[name_node(n, True)], value=site.count)]
            if site.form == "store":
                stmts.append(ast.Expr(call_ops("store_slices", site.target, name_node(n), batched)))
            elif site.form == "extend":
                stmts.append(
                    ast.Expr(
                        ast.Call(
                            func=ast.Attribute(value=site.target, attr="extend", ctx=ast.Load()),
                            args=[call_ops("unstack", batched)],
                            keywords=[],
                        )
                    )
                )
            else:
                stmts.append(ast.Assign(targets=[name_node(f"__sk_batch_{k}", True)], value=call_ops("stack", batched)))
                site.block.remove(site.init)  # type: ignore[arg-type]
                replace[id(site.stack_call)] = name_node(f"__sk_batch_{k}")
            at = site.block.index(site.loop)  # type: ignore[arg-type]
            site.block[at : at + 1] = [ast.copy_location(st, site.loop) for st in stmts]  # type: ignore[arg-type]
    if replace:
        Replace(replace).visit(tree)


def source_has_candidates(cls: type) -> bool:
    """For a forward speedkit cannot rewrite: would its source have offered anything?"""
    try:
        tree = parse_function(cls.forward).node
        args = tree.args.posonlyargs + tree.args.args  # type: ignore[union-attr]
        return bool(Finder(tree, args[0].arg).run().sites)  # type: ignore[arg-type]
    except Exception:  # no source, no self argument, … : nothing to say
        return False


GEMMS = Rewriter("batched", find, emit)
