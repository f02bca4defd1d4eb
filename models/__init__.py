"""The networks and the files that hold them, shared by both stages and by evaluation: the ResNet and its
heads, the input normalisation, the one torch-file reader and writer, the checkpoint, encoder and release files."""
