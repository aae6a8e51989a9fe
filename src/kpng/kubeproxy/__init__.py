"""``kpng kube-proxy``: kpng as a drop-in for kube-proxy.

It takes kube-proxy's command line and configuration file (``config.py``, pure), sets the
conntrack sysctls kube-proxy sets (``conntrack.py``), and runs the pipeline kpng's own command
line would write as ``kpng kube ... to-local ... to-nft ...`` (``command.py``), which it logs.
"""
