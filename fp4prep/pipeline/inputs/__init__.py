"""What a run is given, read and checked without torch: the adapter's files, the calibration
conversations, the general text, and the corpus built from them."""
