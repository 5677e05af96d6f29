# Shape: fastai's tabular tutorial ("Tabular training"),
# https://docs.fast.ai/tutorial.tabular.html (Apache-2.0, fast.ai, fastai/fastai
# nbs/44_tutorial.tabular.ipynb; read 2025). Written anew in that tutorial's shape, not
# copied: this project keeps third-party code out of its commits. Kept from it:
# `from fastai.tabular.all import *`; a pandas DataFrame of the adult census' kind (cat
# columns workclass, education, marital-status, occupation, relationship, race; cont
# columns age, fnlwgt, education-num; target salary as two strings);
# TabularDataLoaders.from_df(df, path, procs=[Categorify, FillMissing, Normalize],
# cat_names=, cont_names=, y_names="salary", valid_idx=, bs=64); tabular_learner(dls,
# metrics=accuracy); learn.fit_one_cycle(2); learn.show_results().
# Changed: untar_data(URLs.ADULT_SAMPLE) and its adult.csv swapped for 640 rows made in code
# (seeded; a few missing values, for FillMissing; the salary drawn from age, education-num
# and two categories); 512 training rows (valid_idx the last 128) in batches of 64.
import numpy as np
import pandas as pd
from fastai.tabular.all import (Categorify, FillMissing, Normalize, TabularDataLoaders, accuracy,
                                tabular_learner)

rng = np.random.default_rng(0)
n = 640
df = pd.DataFrame({
    "age": rng.integers(17, 80, n).astype(float),
    "workclass": rng.choice(["Private", "Self-emp", "Gov", "Without-pay"], n),
    "fnlwgt": rng.normal(190_000, 100_000, n).clip(10_000, None),
    "education": rng.choice(["HS-grad", "Some-college", "Bachelors", "Masters", "Doctorate"], n),
    "education-num": rng.integers(1, 17, n).astype(float),
    "marital-status": rng.choice(["Married", "Never-married", "Divorced"], n),
    "occupation": rng.choice(["Tech-support", "Sales", "Exec-managerial", "Craft-repair", "Other"], n),
    "relationship": rng.choice(["Husband", "Wife", "Own-child", "Not-in-family"], n),
    "race": rng.choice(["White", "Black", "Asian-Pac-Islander", "Other"], n),
})
score = (df["age"] - 40) / 12 + (df["education-num"] - 9) / 3 + (df["marital-status"] == "Married") \
    + (df["occupation"] == "Exec-managerial") + rng.normal(0, 0.5, n)
df["salary"] = np.where(score > 1.0, ">=50k", "<50k")
df.loc[rng.choice(n, 20, replace=False), "education-num"] = np.nan   # FillMissing's work
df.loc[rng.choice(n, 10, replace=False), "occupation"] = np.nan

path = "."
dls = TabularDataLoaders.from_df(df, path, y_names="salary",
                                 cat_names=["workclass", "education", "marital-status", "occupation",
                                            "relationship", "race"],
                                 cont_names=["age", "fnlwgt", "education-num"],
                                 procs=[Categorify, FillMissing, Normalize],
                                 valid_idx=list(range(512, 640)), bs=64)
learn = tabular_learner(dls, metrics=accuracy)
learn.fit_one_cycle(2)
learn.show_results()
