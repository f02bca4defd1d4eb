"""The kNN scoring that the pretraining monitor and `relicv2 eval knn` run."""
