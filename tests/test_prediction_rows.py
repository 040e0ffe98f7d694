"""The predictions file's rows (utils/predict/prediction_rows.py), in this process: the inputs padded to whole
batches, the gathered columns back in input order, one row per input, unreadable inputs as rows of their own.
(tests/test_predict.py runs scripts/predict.py on 1, 2 and 3 processes through the same code; these take milliseconds,
so that the mutation run of docs/testing.md, "Mutation testing", can run them for every mutant.)"""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from utils.errors import UserError
from utils.predict.prediction_rows import WholeBatches, predictions_csv
from utils.predict.trained_run import Inputs


class SomeUnreadable(Dataset):
    """Inputs 0..n-1, those in `bad` unreadable (a UserError naming them, as a corrupt image file's)."""

    def __init__(self, n, bad, labels):
        self.n, self.bad, self.labels = n, bad, labels

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index in self.bad:
            raise UserError(f"input {index} is unreadable")
        return torch.full((1,), index), self.labels[index]


def test_the_inputs_are_padded_to_whole_batches_with_copies_of_the_first():
    """13 inputs in batches of 4: 16 positions, every batch whole (a smaller last batch can round differently,
    so its probabilities would depend on the process count), positions 13-15 the first 3 inputs again."""
    inputs = TensorDataset(torch.arange(13).view(13, 1), torch.arange(13) % 4)
    batches = WholeBatches(inputs, 4, torch.zeros(1, dtype=torch.int64), stop_on_error=True)
    assert len(batches) == 16
    assert [len(positions) for _, _, positions, _ in DataLoader(batches, batch_size=4)] == [4, 4, 4, 4]
    assert [batches[p][0].item() for p in range(16)] == [*range(13), 0, 1, 2]
    assert [batches[p][2] for p in range(16)] == list(range(16))


def test_the_rows_are_in_input_order_whatever_the_order_gathered():
    """The columns as 2 processes gather them (the padding included), shuffled: one row per input, in input order,
    each with its own prediction; a position gathered twice, or missing, stops with an error."""
    inputs = Inputs(TensorDataset(torch.zeros(5, 1), torch.tensor([0, 1, 2, 0, 1])), torch.zeros(1),
                    ["a", "b", "c"], lambda i: f"eval/{i}", "5 inputs")
    batches = WholeBatches(inputs.dataset, 4, inputs.blank, stop_on_error=True)
    positions = torch.tensor([6, 2, 0, 4, 7, 3, 1, 5])  # 5, 6 and 7 are padding: copies of inputs 0, 1 and 2
    labels = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2])[positions]
    predicted = (positions + 1) % 3  # each input's own top class, from its position
    probability = positions / 10
    columns = tuple([column[:4], column[4:]] for column in (positions, torch.zeros(8, dtype=torch.int64), labels,
                                                            predicted[:, None], probability[:, None]))
    text, counts = predictions_csv(columns, inputs, batches, ["a", "b", "c"], top_k=1)
    assert text.splitlines() == ["index,source,label,class_1,probability_1,error",
                                 "0,eval/0,a,b,0.000000,", "1,eval/1,b,c,0.100000,", "2,eval/2,c,a,0.200000,",
                                 "3,eval/3,a,b,0.300000,", "4,eval/4,b,c,0.400000,"]
    assert counts == {"labelled": 5, "correct": 0, "unreadable": 0}
    twice = tuple([torch.cat(column)[[2, 1, 1, 5, 3]]] for column in columns)  # inputs 0, 2, 2, 3, 4: 1 is missing
    with pytest.raises(RuntimeError, match="not each once"):
        predictions_csv(twice, inputs, batches, ["a", "b", "c"], top_k=1)


@pytest.mark.parametrize("num_inputs, batch_size, length", [(12, 4, 12), (1, 4, 4), (5, 1, 5), (4, 5, 5)])
def test_the_padding_is_to_the_next_whole_batch_only(num_inputs, batch_size, length):
    inputs = TensorDataset(torch.arange(num_inputs), torch.zeros(num_inputs, dtype=torch.int64))
    batches = WholeBatches(inputs, batch_size, torch.zeros(()), stop_on_error=False)
    assert len(batches) == length
    assert [batches[p][0].item() for p in range(length)] == [p % num_inputs for p in range(length)]


def test_an_unreadable_input_is_a_blank_flagged_or_stops_the_run():
    inputs = SomeUnreadable(3, bad={1}, labels=[2, 0, 1])
    blank = torch.full((1,), -7)
    batches = WholeBatches(inputs, 2, blank, stop_on_error=False)
    assert [(image.item(), label, position, unreadable) for image, label, position, unreadable in
            (batches[p] for p in range(4))] == [(0, 2, 0, 0), (-7, -1, 1, 1), (2, 1, 2, 0), (0, 2, 3, 0)]
    assert batches.error_of(1) == "input 1 is unreadable" and batches.error_of(2) == ""
    with pytest.raises(UserError, match="input 1 is unreadable"):
        WholeBatches(inputs, 2, blank, stop_on_error=True)[1]


def test_each_row_has_its_inputs_top_k_its_label_and_its_error_and_the_counts_are_of_the_readable_labelled():
    """Top 2 of 3 classes for 5 inputs in batches of 3 gathered by 2 processes, one padding position: inputs 1 and 4
    unreadable (their rows empty but for their error), input 3 without a label (its predictions, counted neither
    labelled nor correct). Lines end in a newline alone (csv's default is \\r\\n)."""
    inputs = Inputs(SomeUnreadable(5, bad={1, 4}, labels=[0, 1, 2, -1, 0]), torch.zeros(1), ["cat", "dog", "eel"],
                    lambda i: f"img{i}.png", "5 inputs")
    batches = WholeBatches(inputs.dataset, 3, inputs.blank, stop_on_error=False)
    positions = torch.tensor([5, 3, 1, 0, 2, 4])  # 5: padding (a copy of input 0)
    unreadable = torch.tensor([0, 0, 1, 0, 0, 1])
    labels = torch.tensor([0, -1, -1, 0, 2, -1])
    classes = torch.tensor([[1, 0], [2, 1], [0, 0], [0, 2], [1, 2], [0, 0]])
    probabilities = torch.tensor([[0.9, 0.1], [0.5, 0.25], [0.0, 0.0], [0.7, 0.2], [0.6000004, 0.3999996], [0, 0]])
    columns = tuple([column[:3], column[3:]] for column in (positions, unreadable, labels, classes, probabilities))
    text, counts = predictions_csv(columns, inputs, batches, ["cat", "dog", "eel"], top_k=2)
    assert text == "".join(f"{line}\n" for line in [
        "index,source,label,class_1,probability_1,class_2,probability_2,error",
        "0,img0.png,cat,cat,0.700000,eel,0.200000,",
        "1,img1.png,,,,,,input 1 is unreadable",
        "2,img2.png,eel,dog,0.600000,eel,0.400000,",
        "3,img3.png,,eel,0.500000,dog,0.250000,",
        "4,img4.png,,,,,,input 4 is unreadable"])
    assert counts == {"labelled": 2, "correct": 1, "unreadable": 2}


def test_the_rows_must_be_each_input_once():
    inputs = Inputs(TensorDataset(torch.zeros(3, 1), torch.tensor([0, 1, 0])), torch.zeros(1), ["a", "b"],
                    lambda i: f"eval/{i}", "3 inputs")
    batches = WholeBatches(inputs.dataset, 2, inputs.blank, stop_on_error=True)

    def rows(*positions):
        positions = torch.tensor(positions)
        n = len(positions)
        return predictions_csv(([positions], [torch.zeros(n, dtype=torch.int64)], [torch.zeros(n, dtype=torch.int64)],
                                [torch.zeros(n, 1, dtype=torch.int64)], [torch.ones(n, 1)]), inputs, batches,
                               ["a", "b"], top_k=1)

    assert rows(3, 2, 1, 0)[1] == {"labelled": 3, "correct": 3, "unreadable": 0}
    for wrong, found in (((0, 1, 3), 2), ((0, 1, 1, 2), 4), ((0, 2), 2), ((0, 1, 2, 2, 3), 4)):
        with pytest.raises(RuntimeError) as error:
            rows(*wrong)
        assert str(error.value) == f"gathered {found} rows for 3 inputs, not each once"
