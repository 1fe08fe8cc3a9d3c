"""Evaluation: ``bdlora eval`` of any folder (``evaluate``), the teacher's cached reference figures
(``reference``) and in-context-learning tasks (``icl``). Beside compress and train: it reads their runs."""
