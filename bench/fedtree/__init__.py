"""A benchmark-only job kind: FedAvg as a lambda-FL tree (the peer ``bench/fedavg_tree.py`` runs beside the
sharded job on the same executor). Registered only by that benchmark (``SHARDFOLD_KIND_PACKAGES=fedtree``);
never deployed."""
