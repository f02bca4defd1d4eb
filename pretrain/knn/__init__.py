"""The kNN scoring the pretraining monitor runs every few steps, and `relicv2 eval knn` runs once: feature
extraction, the weighted kNN vote, the class-list check and the lost-sample accounting."""
