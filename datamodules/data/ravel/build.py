"""Write our own RAVEL-layout files (city, physical_object) from the facts below.

Run `python datamodules/data/ravel/build.py` to regenerate the JSON files beside it. Everything
here is written by us: common facts, our own template wording. Splits are stratified (by
continent for cities, by category for objects, by attribute for templates) and deterministic.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent

# city -> (country, continent, language): the main language of the city
CITIES = """
Paris|France|Europe|French
Lyon|France|Europe|French
Marseille|France|Europe|French
Nice|France|Europe|French
Bordeaux|France|Europe|French
Berlin|Germany|Europe|German
Munich|Germany|Europe|German
Hamburg|Germany|Europe|German
Frankfurt|Germany|Europe|German
Cologne|Germany|Europe|German
Vienna|Austria|Europe|German
Salzburg|Austria|Europe|German
Zurich|Switzerland|Europe|German
Geneva|Switzerland|Europe|French
Rome|Italy|Europe|Italian
Milan|Italy|Europe|Italian
Naples|Italy|Europe|Italian
Venice|Italy|Europe|Italian
Florence|Italy|Europe|Italian
Madrid|Spain|Europe|Spanish
Seville|Spain|Europe|Spanish
Lisbon|Portugal|Europe|Portuguese
Porto|Portugal|Europe|Portuguese
London|United Kingdom|Europe|English
Manchester|United Kingdom|Europe|English
Liverpool|United Kingdom|Europe|English
Edinburgh|United Kingdom|Europe|English
Dublin|Ireland|Europe|English
Amsterdam|Netherlands|Europe|Dutch
Rotterdam|Netherlands|Europe|Dutch
Antwerp|Belgium|Europe|Dutch
Copenhagen|Denmark|Europe|Danish
Stockholm|Sweden|Europe|Swedish
Gothenburg|Sweden|Europe|Swedish
Oslo|Norway|Europe|Norwegian
Helsinki|Finland|Europe|Finnish
Reykjavik|Iceland|Europe|Icelandic
Warsaw|Poland|Europe|Polish
Krakow|Poland|Europe|Polish
Prague|Czech Republic|Europe|Czech
Budapest|Hungary|Europe|Hungarian
Athens|Greece|Europe|Greek
Moscow|Russia|Europe|Russian
Saint Petersburg|Russia|Europe|Russian
Kyiv|Ukraine|Europe|Ukrainian
Bucharest|Romania|Europe|Romanian
Sofia|Bulgaria|Europe|Bulgarian
Belgrade|Serbia|Europe|Serbian
Zagreb|Croatia|Europe|Croatian
Tokyo|Japan|Asia|Japanese
Osaka|Japan|Asia|Japanese
Kyoto|Japan|Asia|Japanese
Yokohama|Japan|Asia|Japanese
Hiroshima|Japan|Asia|Japanese
Beijing|China|Asia|Chinese
Shanghai|China|Asia|Chinese
Guangzhou|China|Asia|Chinese
Shenzhen|China|Asia|Chinese
Wuhan|China|Asia|Chinese
Chengdu|China|Asia|Chinese
Seoul|South Korea|Asia|Korean
Busan|South Korea|Asia|Korean
Pyongyang|North Korea|Asia|Korean
Bangkok|Thailand|Asia|Thai
Chiang Mai|Thailand|Asia|Thai
Hanoi|Vietnam|Asia|Vietnamese
Ho Chi Minh City|Vietnam|Asia|Vietnamese
Jakarta|Indonesia|Asia|Indonesian
Kuala Lumpur|Malaysia|Asia|Malay
New Delhi|India|Asia|Hindi
Kolkata|India|Asia|Bengali
Chennai|India|Asia|Tamil
Karachi|Pakistan|Asia|Urdu
Islamabad|Pakistan|Asia|Urdu
Dhaka|Bangladesh|Asia|Bengali
Kathmandu|Nepal|Asia|Nepali
Colombo|Sri Lanka|Asia|Sinhala
Tehran|Iran|Asia|Persian
Isfahan|Iran|Asia|Persian
Baghdad|Iraq|Asia|Arabic
Riyadh|Saudi Arabia|Asia|Arabic
Jeddah|Saudi Arabia|Asia|Arabic
Mecca|Saudi Arabia|Asia|Arabic
Dubai|United Arab Emirates|Asia|Arabic
Doha|Qatar|Asia|Arabic
Damascus|Syria|Asia|Arabic
Beirut|Lebanon|Asia|Arabic
Amman|Jordan|Asia|Arabic
Tel Aviv|Israel|Asia|Hebrew
Ankara|Turkey|Asia|Turkish
Tashkent|Uzbekistan|Asia|Uzbek
Ulaanbaatar|Mongolia|Asia|Mongolian
Yangon|Myanmar|Asia|Burmese
Phnom Penh|Cambodia|Asia|Khmer
Cairo|Egypt|Africa|Arabic
Alexandria|Egypt|Africa|Arabic
Luxor|Egypt|Africa|Arabic
Casablanca|Morocco|Africa|Arabic
Marrakesh|Morocco|Africa|Arabic
Rabat|Morocco|Africa|Arabic
Tunis|Tunisia|Africa|Arabic
Algiers|Algeria|Africa|Arabic
Tripoli|Libya|Africa|Arabic
Khartoum|Sudan|Africa|Arabic
Addis Ababa|Ethiopia|Africa|Amharic
Nairobi|Kenya|Africa|Swahili
Mombasa|Kenya|Africa|Swahili
Dar es Salaam|Tanzania|Africa|Swahili
Zanzibar|Tanzania|Africa|Swahili
Lagos|Nigeria|Africa|English
Abuja|Nigeria|Africa|English
Accra|Ghana|Africa|English
Dakar|Senegal|Africa|French
Abidjan|Ivory Coast|Africa|French
Kinshasa|Democratic Republic of the Congo|Africa|French
Bamako|Mali|Africa|French
Luanda|Angola|Africa|Portuguese
Maputo|Mozambique|Africa|Portuguese
Johannesburg|South Africa|Africa|English
Cape Town|South Africa|Africa|English
Durban|South Africa|Africa|English
Harare|Zimbabwe|Africa|English
Antananarivo|Madagascar|Africa|Malagasy
New York City|United States|North America|English
Los Angeles|United States|North America|English
Chicago|United States|North America|English
Houston|United States|North America|English
Miami|United States|North America|English
San Francisco|United States|North America|English
Seattle|United States|North America|English
Boston|United States|North America|English
Las Vegas|United States|North America|English
Dallas|United States|North America|English
Atlanta|United States|North America|English
Denver|United States|North America|English
Philadelphia|United States|North America|English
Detroit|United States|North America|English
New Orleans|United States|North America|English
Toronto|Canada|North America|English
Vancouver|Canada|North America|English
Calgary|Canada|North America|English
Ottawa|Canada|North America|English
Montreal|Canada|North America|French
Quebec City|Canada|North America|French
Mexico City|Mexico|North America|Spanish
Guadalajara|Mexico|North America|Spanish
Monterrey|Mexico|North America|Spanish
Cancun|Mexico|North America|Spanish
Havana|Cuba|North America|Spanish
Guatemala City|Guatemala|North America|Spanish
Panama City|Panama|North America|Spanish
Santo Domingo|Dominican Republic|North America|Spanish
Sao Paulo|Brazil|South America|Portuguese
Rio de Janeiro|Brazil|South America|Portuguese
Brasilia|Brazil|South America|Portuguese
Recife|Brazil|South America|Portuguese
Buenos Aires|Argentina|South America|Spanish
Mendoza|Argentina|South America|Spanish
Santiago|Chile|South America|Spanish
Valparaiso|Chile|South America|Spanish
Lima|Peru|South America|Spanish
Cusco|Peru|South America|Spanish
Bogota|Colombia|South America|Spanish
Medellin|Colombia|South America|Spanish
Caracas|Venezuela|South America|Spanish
Quito|Ecuador|South America|Spanish
Guayaquil|Ecuador|South America|Spanish
La Paz|Bolivia|South America|Spanish
Montevideo|Uruguay|South America|Spanish
Asuncion|Paraguay|South America|Spanish
Sydney|Australia|Oceania|English
Melbourne|Australia|Oceania|English
Brisbane|Australia|Oceania|English
Perth|Australia|Oceania|English
Adelaide|Australia|Oceania|English
Canberra|Australia|Oceania|English
Hobart|Australia|Oceania|English
Auckland|New Zealand|Oceania|English
Wellington|New Zealand|Oceania|English
Christchurch|New Zealand|Oceania|English
"""

# object -> (category, color, size, texture); size: small = fits in a hand, large = bigger than
# a person; texture: how it feels to the touch
OBJECTS = """
sheep|animal|white|large|soft
polar bear|animal|white|large|soft
mouse|animal|gray|small|soft
chick|animal|yellow|small|soft
canary|animal|yellow|small|soft
duckling|animal|yellow|small|soft
flamingo|animal|pink|large|soft
frog|animal|green|small|soft
grasshopper|animal|green|small|hard
crab|animal|red|small|hard
ladybug|animal|red|small|hard
beetle|animal|black|small|hard
ant|animal|black|small|hard
bat|animal|black|small|soft
camel|animal|brown|large|soft
brown bear|animal|brown|large|soft
gorilla|animal|black|large|soft
black panther|animal|black|large|soft
goldfish|animal|orange|small|soft
banana|fruit|yellow|small|soft
strawberry|fruit|red|small|soft
raspberry|fruit|red|small|soft
cherry|fruit|red|small|soft
cranberry|fruit|red|small|hard
blueberry|fruit|blue|small|soft
blackberry|fruit|black|small|soft
blackcurrant|fruit|black|small|soft
plum|fruit|purple|small|soft
coconut|fruit|brown|small|hard
carrot|vegetable|orange|small|hard
potato|vegetable|brown|small|hard
radish|vegetable|red|small|hard
cucumber|vegetable|green|small|hard
lettuce|vegetable|green|small|soft
garlic|vegetable|white|small|hard
fire truck|vehicle|red|large|hard
school bus|vehicle|yellow|large|hard
taxi|vehicle|yellow|large|hard
ambulance|vehicle|white|large|hard
double-decker bus|vehicle|red|large|hard
army tank|vehicle|green|large|hard
hearse|vehicle|black|large|hard
limousine|vehicle|black|large|hard
butter|food|yellow|small|soft
marshmallow|food|white|small|soft
chocolate bar|food|brown|small|hard
egg|food|white|small|hard
cookie|food|brown|small|hard
sugar cube|food|white|small|hard
grain of rice|food|white|small|hard
ruby|gemstone|red|small|hard
emerald|gemstone|green|small|hard
sapphire|gemstone|blue|small|hard
pearl|gemstone|white|small|hard
amethyst|gemstone|purple|small|hard
pencil|tool|yellow|small|hard
eraser|tool|pink|small|soft
chalk|tool|white|small|hard
sponge|household item|yellow|small|soft
cotton ball|household item|white|small|soft
candle|household item|white|small|hard
teddy bear|toy|brown|small|soft
rubber duck|toy|yellow|small|soft
refrigerator|appliance|white|large|hard
washing machine|appliance|white|large|hard
piano|instrument|black|large|hard
"""

CITY_PROMPTS = {
    "Country": [
        "%s is a city in the country of",
        "The city of %s is located in the country of",
        "Q: Which country is %s in? A:",
        '{"city": "Toulouse", "country": "France"}, {"city": "%s", "country": "',
        "city: Nagoya, country: Japan\ncity: %s, country:",
        "Having lived in %s for years, she holds a passport from",
        "%s is one of the largest cities of",
        "Country of %s:",
        '[{"name": "Pune", "country": "India"}, {"name": "%s", "country": "',
        "I flew to %s, so my trip took me to the country of",
    ],
    "Continent": [
        "%s is a city on the continent of",
        "The city of %s is located on the continent of",
        "Q: On which continent is %s? A:",
        '{"city": "Toulouse", "continent": "Europe"}, {"city": "%s", "continent": "',
        "city: Nagoya, continent: Asia\ncity: %s, continent:",
        "To visit %s, you have to travel to the continent of",
        "Continent of %s:",
        '[{"name": "Pune", "continent": "Asia"}, {"name": "%s", "continent": "',
        "Geographers place %s on the continent of",
        "%s lies on the continent of",
    ],
    "Language": [
        "In %s, most people speak",
        "The main language spoken in %s is",
        "Q: What language do people speak in %s? A:",
        '{"city": "Toulouse", "language": "French"}, {"city": "%s", "language": "',
        "city: Nagoya, language: Japanese\ncity: %s, language:",
        "The street signs in %s are written in",
        "People who grow up in %s usually speak",
        "Language of %s:",
        '[{"name": "Pune", "language": "Marathi"}, {"name": "%s", "language": "',
        "The local newspapers of %s are printed in",
    ],
}

OBJECT_PROMPTS = {
    "Category": [
        "The %s is a kind of",
        '{"object": "hammer", "category": "tool"}, {"object": "%s", "category": "',
        "object: lion, category: animal\nobject: %s, category:",
        "Q: What kind of thing is the %s? A: It is a",
        "In a catalogue sorted by type, the %s is listed under",
        "Category of the %s:",
        '[{"item": "apple", "type": "fruit"}, {"item": "%s", "type": "',
        "Broadly speaking, the %s is a",
    ],
    "Color": [
        "The color of the %s is",
        '{"object": "lemon", "color": "yellow"}, {"object": "%s", "color": "',
        "object: snow, color: white\nobject: %s, color:",
        "Q: What color is the %s? A: It is",
        "When children draw the %s, they colour it",
        "Color of the %s:",
        '[{"item": "grass", "colour": "green"}, {"item": "%s", "colour": "',
        "Most people picture the %s as being",
    ],
    "Size": [
        "A coin is small and a bus is large. The %s is",
        '{"object": "coin", "size": "small"}, {"object": "bus", "size": "large"}, {"object": "%s", "size": "',
        "object: key, size: small\nobject: house, size: large\nobject: %s, size:",
        "Q: Is the %s small or large? A: It is",
        "Small or large? The %s is",
        "Size of the %s (small or large):",
        '[{"item": "button", "size": "small"}, {"item": "ship", "size": "large"}, {"item": "%s", "size": "',
        "Next to a person, the %s looks",
    ],
    "Texture": [
        "A pillow is soft and a rock is hard. The %s is",
        '{"object": "pillow", "texture": "soft"}, {"object": "rock", "texture": "hard"}, {"object": "%s", "texture": "',
        "object: towel, texture: soft\nobject: brick, texture: hard\nobject: %s, texture:",
        "Q: Is the %s soft or hard? A: It is",
        "Soft or hard? The %s is",
        "Texture of the %s (soft or hard):",
        '[{"item": "wool", "feel": "soft"}, {"item": "stone", "feel": "hard"}, {"item": "%s", "feel": "',
        "If you squeeze the %s, it feels",
    ],
}

# Sentences that mention an entity and query none of its attributes (the Wikipedia-style
# sources of RAVEL); `{n}` is a number that keeps every prompt unique.
CITY_WIKI = [
    "In {n}, the annual marathon of %s drew thousands of runners who",
    "The old market square of %s was rebuilt in {n} after",
    "A new bridge over the river in %s opened in {n}, and",
    "The football club from %s won its first trophy in {n} when",
]
OBJECT_WIKI = [
    "In chapter {n} of the children's book, the %s appears and",
    "The museum's exhibit no. {n} shows the %s that",
    "Photograph {n} in the collection is a close-up of the %s taken",
]

SPLIT_PATTERN = ["train", "val", "train", "test"]  # 50/25/25


def stratified_split(groups: dict[str, list[str]], seed: int) -> dict[str, str]:
    """Shuffle each group and deal it out train/val/train/test, continuing across groups."""
    rng, split, k = random.Random(seed), {}, 0
    for name in sorted(groups):
        members = sorted(groups[name])
        rng.shuffle(members)
        for m in members:
            split[m] = SPLIT_PATTERN[k % 4]
            k += 1
    return split


def parse(table: str, attributes: list[str]) -> dict[str, dict[str, str]]:
    rows = [line.split("|") for line in table.strip().splitlines()]
    assert all(len(r) == len(attributes) + 1 for r in rows), [r for r in rows if len(r) != len(attributes) + 1]
    return {r[0]: dict(zip(attributes, r[1:])) for r in rows}


def wikipedia(entities: list[str], frames: list[str], split: dict[str, str], per_entity: int, seed: int):
    rng, out, n = random.Random(seed), {}, 1900
    for entity in entities:
        for frame in rng.sample(frames, per_entity):
            n += 1
            out[frame.format(n=n)] = {"split": split[entity], "entity": entity}
    return out


def build(entity_type: str, table: str, attributes: list[str], group_by: str, prompts, frames, seed: int):
    entities = parse(table, attributes)
    assert len(entities) == len(table.strip().splitlines()), "duplicate entity"
    groups = defaultdict(list)
    for e, attrs in entities.items():
        groups[attrs[group_by]].append(e)
    entity_split = stratified_split(groups, seed)
    prompt_split = stratified_split(prompts, seed + 1)
    wiki_entities = random.Random(seed + 2).sample(sorted(entities), 40)
    files = {
        f"ravel_{entity_type}_entity_attributes.json": entities,
        f"ravel_{entity_type}_attribute_to_prompts.json": prompts,
        f"ravel_{entity_type}_entity_to_split.json": entity_split,
        f"ravel_{entity_type}_prompt_to_split.json": prompt_split,
        f"wikipedia_{entity_type}_entity_prompts.json": wikipedia(wiki_entities, frames, entity_split, 2, seed + 3),
    }
    for name, content in files.items():
        (HERE / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    build("city", CITIES, ["Country", "Continent", "Language"], "Continent", CITY_PROMPTS, CITY_WIKI, seed=0)
    build("physical_object", OBJECTS, ["Category", "Color", "Size", "Texture"], "Category", OBJECT_PROMPTS,
          OBJECT_WIKI, seed=0)
