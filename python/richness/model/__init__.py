"""Reading a torch model: finding and hooking its head and layers
(``hooks.py``), taking rows, labels and tokens from loader batches
(``batches.py``), the thread policy of core updates under torch
(``threads.py``) and ``evaluate``, one pass over a loader (``evaluate.py``)."""
