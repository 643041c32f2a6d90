"""The needle sweep and the fault rows: contexts x depths x trials x formats x top-k, one record per run."""

from __future__ import annotations

from ..formats import KeyFormat, is_centred
from .faults import FAULTS, Fault
from .haystack import HaystackPool, StoredHaystack
from .settings import ProgressFn, RecallSettings, generator_for, lab_device, rope_table


def run_sweep(settings: RecallSettings, on_run: ProgressFn | None = None) -> list[dict]:
    """The needle sweep: contexts x depths x trials x formats x topks through the ops. One record per run.
    With ``settings.hierarchy`` the top-k op is ``hierarchical_topk`` (``settings.hierarchy_config()``)."""
    device = lab_device(settings.backend)
    pool = HaystackPool(settings)
    table = rope_table(settings, max(settings.contexts))
    none = FAULTS["none"]
    records = []
    for ctx in settings.contexts:
        for trial in range(settings.trials):
            stored = StoredHaystack(pool.get(ctx, trial), settings.formats, none, table, settings.backend, device,
                                    hierarchy=settings.hierarchy_config())
            for d_index, depth in enumerate(settings.depths):
                gen = generator_for(settings.seed, "needle", ctx, trial, d_index)
                for rec in stored.run_depth(depth, gen, settings.topks):
                    rec["trial"] = trial
                    records.append(rec)
                    if on_run:
                        on_run(rec)
    return records


def fault_carriers(settings: RecallSettings) -> list[tuple[Fault, KeyFormat]]:
    """(fault, format) pairs of the fault rows.

    Convention faults run on ``fault_format`` (bf16 by default, so the fault is the only error in the row);
    the fp8 read faults run on it when it is an fp8 format (fp8-centred included) and on fp8 otherwise; the
    faults of page-centred keys (missing-centre) on it when it is centred and on fp8-centred otherwise. Each
    carrier format gets its own baseline row ('none').
    """
    carrier = KeyFormat.parse(settings.fault_format)
    fp8_carrier = carrier if carrier.kind == "fp8" else KeyFormat.FP8
    centred_carrier = carrier if is_centred(carrier) else KeyFormat.FP8_CENTRED
    pairs: list[tuple[Fault, KeyFormat]] = []
    for name in settings.faults:
        fault = FAULTS[name]
        fmt = centred_carrier if fault.centred_only else fp8_carrier if fault.fp8_only else carrier
        if fault.name != "none" and (FAULTS["none"], fmt) not in pairs:
            pairs.append((FAULTS["none"], fmt))
        if (fault, fmt) not in pairs:
            pairs.append((fault, fmt))
    return pairs


def run_faults(settings: RecallSettings, on_run: ProgressFn | None = None) -> list[dict]:
    """Fault rows: each fault of ``settings.faults`` at the fault contexts and depths (see fault_carriers)."""
    pairs = fault_carriers(settings)
    if not pairs:
        return []
    device = lab_device(settings.backend)
    pool = HaystackPool(settings)
    table = rope_table(settings, max(settings.fault_contexts))
    k = settings.topks[0]
    records = []
    for ctx in settings.fault_contexts:
        for trial in range(settings.fault_trials):
            hay = pool.get(ctx, trial)
            for fault, fmt in pairs:
                stored = StoredHaystack(hay, [fmt.name], fault, table, settings.backend, device)
                for d_index, depth in enumerate(settings.fault_depths):
                    gen = generator_for(settings.seed, "fault-needle", ctx, trial, d_index)
                    for rec in stored.run_depth(depth, gen, [k]):
                        rec["trial"] = trial
                        rec["kind"] = "fault"
                        records.append(rec)
                        if on_run:
                            on_run(rec)
    return records
