"""The PEtab benchmark problems that ship with sciflat: unchanged copies from the
benchmark collection (BSD 3-Clause licence, in `data/LICENSE`), so that the docs'
examples run after `pip install`."""

import pathlib


_DATA = pathlib.Path(__file__).parent / "data"


def petab_benchmark(name: str) -> pathlib.Path:
    """The YAML file of a PEtab benchmark problem that ships with sciflat, for
    [`sciflat.petab_problem`][].

    One problem of the PEtab benchmark collection (Hass et al., *Bioinformatics*
    35:3073, 2019) ships with the package, unchanged: `"Boehm_JProteomeRes2014"`
    (STAT5 dimerisation; 8 species, 9 estimated parameters, 48 measurements; the
    log-likelihood at its published fit is −138.22199693517703 by AMICI). The others
    are in the collection's repository (Benchmarking-Initiative/Benchmark-Models-PEtab).

    !!! Example

        ```python
        path = sciflat.petab_benchmark("Boehm_JProteomeRes2014")
        problem = sciflat.petab_problem(path)
        ```

    **Arguments:**

    - `name`: the problem's name in the collection.

    **Returns:**

    The path of its YAML file (its tables and SBML model beside it).
    """
    names = sorted(p.name for p in _DATA.iterdir() if (p / f"{p.name}.yaml").is_file())
    if name not in names:
        raise ValueError(
            f"`name` must be one of the problems that ship with sciflat, {names}; got "
            f"{name!r}. Other problems of the collection: download them, and pass "
            "their YAML file to `sciflat.petab_problem`."
        )
    return _DATA / name / f"{name}.yaml"
