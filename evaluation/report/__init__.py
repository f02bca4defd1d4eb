"""The run report: one static HTML page plus PNG figures, built from the files the jobs wrote (`html`: the
page, `plots`: the figures, `inputs`: the readers of the jobs' files, which import no plotting library)."""
