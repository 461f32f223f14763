"""Factory (tools): the mini-K3 and what it is made from.

Synthetic checkpoints at any preset (``synth``, ``moonshot``), the corpus and its BPE
(``corpus``, ``bpe``, ``windows``), the trainer (``minimodel``, ``train``, ``export``,
``curves``) and its quality measures (``quality``). May import every layer below."""
