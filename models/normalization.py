"""The encoder's input normalisation: ImageNet's per-channel mean and std of RGB in [0, 1].

Every path that feeds a ResNet of this project (the views, the evaluations, the saliency network's
backbone) normalises with these; a module of its own so that light modules (configs) can import it
without torch.
"""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
