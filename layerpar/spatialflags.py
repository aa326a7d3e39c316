"""The main job's spatial-coarsening flags (``--spatial-coarsening``, ``--spatial-restrict``,
``--spatial-prolong``; :mod:`mgrit.spatial`): their allowed values and their validation, called
by :func:`layerpar.validation.validate` (no communication; the same verdict on every rank)."""
from __future__ import annotations

from mgrit.options import relaxation_sweeps

__all__ = ["SPATIAL_RESTRICTIONS", "SPATIAL_PROLONGATIONS", "spatial_levels", "check_spatial"]

#: ``--spatial-restrict`` / ``--spatial-prolong`` choices (mgrit.spatial.SpatialCoarsening).
SPATIAL_RESTRICTIONS = ("full_weighting", "injection")
SPATIAL_PROLONGATIONS = ("linear", "constant")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def spatial_levels(text: str) -> tuple:
    """The levels of ``--spatial-coarsening`` (``"1,2"`` -> ``(1, 2)``; ``""`` -> ``()``).

    Raises:
        ValueError: not comma-separated ints >= 1 without repeats, naming the value.
    """
    text = "" if text is None else str(text).strip()
    if not text:
        return ()
    try:
        levels = tuple(int(t) for t in text.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise ValueError(f"--spatial-coarsening={text!r} is not allowed: use MGRIT level "
                         f"numbers >= 1, comma separated, each once (e.g. 1 or 1,2; level 0 "
                         f"is the fine grid)")
    return tuple(sorted(levels))


def check_spatial(c) -> None:
    """--spatial-coarsening, --spatial-restrict, --spatial-prolong: conv steps of --model
    resnet under --method mgrit, levels below --levels; the operators only with levels."""
    levels = spatial_levels(c.spatial_coarsening)
    for name, allowed in (("spatial_restrict", SPATIAL_RESTRICTIONS),
                          ("spatial_prolong", SPATIAL_PROLONGATIONS)):
        v = getattr(c, name)
        if v is not None and v not in allowed:
            raise ValueError(f"{_flag(name)}={v!r} is not allowed: use one of {list(allowed)}")
        if v is not None and not levels:
            raise ValueError(f"{_flag(name)} {v} chooses an operator of spatial coarsening: it "
                             f"needs --spatial-coarsening LEVELS (e.g. 1)")
    if not levels:
        return
    if c.step not in ("conv", "twoconv") or c.model != "resnet":
        raise ValueError(f"--spatial-coarsening coarsens the feature maps of convolutional "
                         f"steps: use --model resnet with --step conv or twoconv (got --model "
                         f"{c.model} --step {c.step})")
    if c.method != "mgrit":
        raise ValueError(f"--spatial-coarsening acts on the coarse MGRIT levels: use --method "
                         f"mgrit (got --method {c.method})")
    if max(levels) >= c.levels:
        raise ValueError(f"--spatial-coarsening={c.spatial_coarsening!r} names level "
                         f"{max(levels)}, but --levels {c.levels} has levels 0..{c.levels - 1}: "
                         f"use levels 1..{c.levels - 1} or more --levels")
    relax = [r.strip() for r in c.relax.split(",")]
    for level in levels:  # F-relaxation never touches the C-points' fine-grid error
        r = relax[min(level - 1, len(relax) - 1)]
        if relaxation_sweeps(r) == 0:
            raise ValueError(f"--spatial-coarsening level {level} needs C-relaxation on level "
                             f"{level - 1}, but --relax {c.relax} gives it {r}: F-relaxation "
                             f"leaves the part of the C-point error the coarse grid cannot "
                             f"represent uncorrected (the solve stagnates); use FCF there, "
                             f"e.g. --relax FCF")
