"""The paper's reproduction suite (``jaxspec repro``): Tables 1-3 and Figures 7-11 of SpecInfer on a jaxspec pair.

``experiments`` runs them, ``paper`` holds the paper's numbers and claims
(``configs/repro/paper.yaml``), ``report`` writes CSV, PNG, markdown and the report,
``measures`` the pure functions Table 1 reads, ``worker`` one system of a latency figure
in its own process.
"""
