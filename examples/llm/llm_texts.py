"""The built-in texts of the LLM example, written for it (dedicated to the public domain): ordinary English prose
that no model has seen verbatim.

* :data:`EVALUATION_PASSAGE` (about 500 tokens) is where perplexity and top-1 agreement are measured.
* :data:`CALIBRATION_TEXT` is what SmoothQuant's factors are calibrated on: other topics, other sentences, and a
  chat turn in the model's own format, so that no number measured on the passage was tuned on it.
* :data:`PROMPT` is the question the example answers.
"""

PROMPT = "Give me three tips for staying focused while studying."

EVALUATION_PASSAGE = """\
The old lighthouse on the northern point has not guided a ship in more than forty years, but the town still \
keeps it painted. Every spring a few volunteers climb the narrow stairs with buckets and brushes, scrape away the \
salt that has gathered on the railings, and give the tower a fresh coat of white. Nobody pays them, and nobody \
asks them to do it. When visitors ask why, the answers vary. Some say the lighthouse is the first thing they see \
when they drive home from the city, and that it tells them they have arrived. Others remember a grandfather who \
kept the lamp burning through long winter nights, walking up and down those same stairs with a can of oil.

The keeper's house at the foot of the tower is now a small museum. It holds a logbook that records the weather \
every day from 1891 to 1979, written in at least six different hands. Most entries are short: wind from the \
west, light rain, two fishing boats returned before dark. A few are longer. In the winter of 1923 a storm drove a \
cargo ship onto the rocks below the point, and the keeper wrote three full pages about the night his family \
spent pulling sailors out of the freezing water with ropes and a borrowed rowing boat. All eleven men survived. \
One of them later married the keeper's daughter, and their descendants still live in the town.

Reading the logbook, one notices how much of the work was simply paying attention. The keeper had to watch the \
sky, the sea and the lamp at the same time, and to write down what he saw whether or not anything happened. \
Most days nothing did. The value of the record comes from its patience: a hundred years of ordinary \
observations, kept without a break, now tell scientists how the local climate has changed. The winters have \
grown milder, the storms have shifted later in the year, and the fog that once covered the harbor for weeks at \
a time has become rare.

Modern ships carry satellite receivers and electronic charts, and they no longer need a light on a hill to find \
their way. Yet the people who maintain the tower do not think of it as useless. They see it as a reminder that \
safety was once the job of a single family, awake all night, trusting that someone out on the dark water was \
grateful for their care. On clear evenings in summer the museum opens late, and children are allowed to climb \
to the top and look out over the bay as the sun goes down.
"""

CALIBRATION_TEXT = """\
<|im_start|>user
How do bees make honey?<|im_end|>
<|im_start|>assistant
Bees collect nectar from flowers and carry it back to the hive in a special stomach. Worker bees pass the nectar \
from one to another, adding enzymes that break its sugars down, and then spread it in the wax cells of the comb. \
They fan it with their wings until most of the water evaporates, and finally seal each cell with a cap of wax.<|im_end|>
A good loaf of bread needs only four ingredients: flour, water, salt and yeast. The baker mixes them into a rough \
dough and leaves it to rest, so that the flour can absorb the water. Kneading then stretches the proteins in the \
flour into long elastic strands, which trap the gas the yeast produces as it feeds on sugars. After a slow rise, \
often overnight in a cool kitchen, the dough is shaped, allowed to rise once more, and baked in a very hot oven. \
Steam in the first minutes keeps the crust soft long enough for the loaf to expand; later the crust hardens and \
browns. Many home bakers say the hardest part is waiting an hour for the bread to cool before cutting it.

The committee met on Tuesday to discuss the budget for next year. After a long debate, the members agreed to \
repair the bridge over the river before building the new library, since the engineers had reported cracks in two \
of its supports. The mayor promised that work on the library would begin as soon as the bridge was safe, probably \
in the autumn. Several residents asked whether the park would also be improved, and were told that the question \
would be taken up at the next meeting in March.
"""
