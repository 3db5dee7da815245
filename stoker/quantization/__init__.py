"""Weight quantization: which scheme a checkpoint or a flag asks for (`config`, pure Python),
how weights are quantized and unpacked (`formats`), and the linear methods that store and
apply them (`methods`). The weight-method seam itself is `stoker/layers/weight_method.py`."""
