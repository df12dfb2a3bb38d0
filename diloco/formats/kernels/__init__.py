"""The formats' arithmetic, vectorised on the tensor's device: block absmax quantisation (``blockquant``), the
sparse selection and Elias-Fano positions (``topk``), fixed-width bit packing (``bitpack``). The layouts they
compute are specified by the format modules (``diloco.formats.int8``, ``int4``, ``topk``)."""
