"""What the runtime's rooms share: phases and one-line failure reports (:mod:`.faults`), the
serial-module adapter of the network protocol (:mod:`.nets`), and the runtime's handling of a
network's solvers -- phase tags, solver replacement, solver states after a failure
(:mod:`.solvers`). Imports only lower floors (``mgrit`` core, ``mgrit.nn``); every other room of
:mod:`mgrit.training` may import it."""
