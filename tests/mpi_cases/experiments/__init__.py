"""MPI check functions of the experiments (reproductions against published outputs)."""
