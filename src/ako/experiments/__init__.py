"""Experiments: grids of runs from a sweep file (`grid`), run resumably (`runner`), and their
plots and tables (`report`): `ako sweep` and `ako report`."""
