"""The word lists of the everyday requests (``chat_requests.py``): things people ask a chat
assistant about, written for the trainer. NOTE: none names a subject of the chat questions of
``scripts/bench_spec.py`` (the benchmark must stay unseen); the tests check it.
"""

from __future__ import annotations

from pcgspec.training.topics import items

TASKS = items("""
unclog a bathroom sink; fix a squeaky door hinge; remove a red wine stain from a carpet; iron a
shirt without creases; sharpen a kitchen knife; hang a heavy picture on a plaster wall; change a
bicycle tyre; jump-start a car; defrost a freezer; descale a kettle; get rid of fruit flies in
the kitchen; repot a cactus; grow tomatoes on a balcony; start a compost bin; make cold brew
coffee; cook rice without it getting sticky; make pizza dough from scratch; poach an egg; brew
loose-leaf tea properly; make a vegetable stock; season a cast iron pan; fold a fitted sheet;
pack a suitcase so nothing wrinkles; tie a bow tie; sew on a button; wash a wool sweater; fall
asleep faster; wake up earlier without feeling tired; stop procrastinating on a big project;
stick to a budget; build an emergency fund; negotiate a higher salary; ask my boss for a day
off; say no to extra work politely; write a good thank-you note; make small talk at a party;
apologize to a friend after an argument; start running as a complete beginner; do a proper
push-up; stretch after sitting all day; learn to juggle three balls; learn to touch type;
memorize a short speech; back up the photos on my phone; set up a home Wi-Fi network; speed up
an old laptop; make a strong password I can remember; clean a laptop keyboard; take better
photos with my phone; start a podcast; teach my dog to sit; introduce a new cat to my dog;
clean a fish tank; keep a sourdough starter going; plan meals for a busy week; organize a messy
closet; get my toddler to eat vegetables; help my teenager with math homework; prepare for a
driving test; parallel park; read a nutrition label; choose a good watermelon; tell if an egg
is still fresh; store fresh herbs so they last; paint a room without making a mess; patch a
small hole in drywall; bleed a radiator; save water at home; lower my electricity bill; get
started with birdwatching; learn to play chess well; start keeping a journal; make new friends
in a new city; prepare for a long flight; deal with jet lag; choose a pair of running shoes;
write a short bio for a conference; make a simple website; learn the basics of Excel; study
for an exam in one week; take notes in a lecture; give a toast at a wedding; calm down before a
presentation
""")

WHYS = [
    tuple(part.strip() for part in item.split("|"))
    for item in items("""
do leaves change colour in autumn | leaves change colour in autumn; does bread go stale | bread
goes stale; is the sky blue during the day | the sky is blue during the day; do we yawn | we
yawn; do onions make people cry | onions make people cry; does ice float on water | ice floats
on water; do dogs wag their tails | dogs wag their tails; do birds fly south for the winter |
birds fly south for the winter; does metal feel colder than wood | metal feels colder than
wood; do we get goosebumps | we get goosebumps; does popcorn pop | popcorn pops; do fingers
wrinkle in the bath | fingers wrinkle in the bath; is the moon sometimes visible during the day
| the moon is sometimes visible during the day; do apples turn brown after being cut | apples
turn brown after being cut; do we have fingerprints | we have fingerprints; does coffee keep
people awake | coffee keeps people awake; do stars twinkle | stars twinkle; does thunder come
after lightning | thunder comes after lightning; do balloons float | balloons float; do
mosquitoes bite some people more than others | mosquitoes bite some people more than others;
does hot water sometimes freeze faster than cold water | hot water sometimes freezes faster
than cold water; do we hiccup | we hiccup; do bananas turn brown | bananas turn brown; do owls
hunt at night | owls hunt at night; do zebras have stripes | zebras have stripes; does the
wind blow | the wind blows; do we dream | we dream; does glass break so easily | glass breaks so
easily; do cut flowers wilt | cut flowers wilt; does salt melt ice on roads | salt melts ice on
roads; do airplanes leave white trails in the sky | airplanes leave white trails in the sky;
does music give people chills | music gives people chills; do bees make honey | bees make
honey; does a spoon look bent in a glass of water | a spoon looks bent in a glass of water; do
some people get carsick | some people get carsick; do we need sleep | we need sleep; does soap
remove grease | soap removes grease; do eyes look red in flash photos | eyes look red in flash
photos; does bread rise | bread rises; do knuckles crack | knuckles crack; do tomatoes taste
better in summer | tomatoes taste better in summer; does the sea have tides | the sea has tides;
do geese fly in a V shape | geese fly in a V shape; does a cold make food taste bland | a cold
makes food taste bland; do snowflakes have six sides | snowflakes have six sides; do old books
smell the way they do | old books smell the way they do; does rust form on iron | rust forms on
iron; do children learn languages so quickly | children learn languages so quickly; do we
blush | we blush; do
rainbows appear after rain | rainbows appear after rain; do chameleons change colour |
chameleons change colour; does spicy food feel hot | spicy food feels hot; do phones get warm
while charging | phones get warm while charging; does my voice sound strange on recordings | my
voice sounds strange on recordings
""")
]

PAIRS = [
    tuple(part.strip() for part in item.split("|"))
    for item in items("""
baking soda | baking powder; a crocodile | an alligator; a virus | a bacterium; a lake | a pond;
a hurricane | a typhoon; a frog | a toad; a rabbit | a hare; an emoji | an emoticon; a debit
card | a credit card; a stock | a bond; a latte | a cappuccino; jam | jelly; a sweet potato | a
yam; a moth | a butterfly; a mushroom | a toadstool; a violin | a viola; a novel | a novella;
a simile | a metaphor; a laptop | a tablet; RAM | storage; Wi-Fi | mobile data; a router | a
modem; an introvert | an extrovert; empathy | sympathy; a psychologist | a psychiatrist; an
allergy | an intolerance; a cold | the flu; jogging | running; yoga | pilates; a mortgage | a
loan; renting | buying a home; a will | a trust; a college | a university; a CV | a resume;
affect | effect; fewer | less; a fruit | a vegetable; a seal | a sea lion; a dolphin | a
porpoise; a wasp | a bee; a leopard | a cheetah; an ape | a monkey; a galaxy | a nebula; an
asteroid | a meteor; a town | a city; a sea | an ocean; a mountain | a hill; a canoe | a kayak;
a ship | a boat; an acoustic guitar | an electric guitar; a duvet | a comforter; white rice |
brown rice; butter | margarine; espresso | filter coffee; green tea | black tea; a podcast | an
audiobook; a hobby | a passion; a goal | a dream; a manager | a leader; a cover letter | a
personal statement; a fact | an opinion; a theory | a law in science; a crown | a filling at
the dentist; sparkling wine | champagne; weight | mass
""")
]

GOALS = items("""
a long car journey with kids; saving money on groceries; keeping a tidy desk; a first day at a
new school; working from home; moving in with a roommate; a first marathon; learning to swim as
an adult; staying focused while studying; keeping houseplants happy in winter; a week of
camping in the rain; cooking for a big family dinner; making a good first impression at a new
job; writing a wedding speech; decorating a small apartment; travelling on a tight budget;
taking care of a new puppy; raising chickens in a backyard; starting a vegetable garden;
running a book club; managing a small team; giving feedback to a coworker; hosting a board game
night; getting through a long winter; staying healthy during exam season; learning to draw;
reading more books this year; organizing a garage sale; selling things online; negotiating the
price of a used car; cycling to work; keeping a conversation going on a first date; visiting a
big museum with children; flying with a baby; planning a surprise party; staying cool in a heat
wave; driving in snow; a weekend in a city I've never visited; writing a college application
essay; speaking up in meetings; learning guitar as an adult; teaching a child to ride a bike;
caring for an elderly parent; keeping a long-distance friendship alive; sleeping well in a
hotel; packing lunches for school; baking bread for the first time; reducing screen time;
decluttering a kitchen; photographing birds; writing a short story; staying motivated at the
gym; a smooth house move; volunteering for the first time
""")

EVENTS = items("""
a summer wedding; a winter wedding; a job fair; a picnic in the park; a first date at a
museum; a beach day; a formal dinner; a music festival; a baby shower; a housewarming party; a
graduation ceremony; a funeral; a company holiday party; a barbecue at a friend's house; a
parent-teacher meeting; a birthday party for a six-year-old; a day at an amusement park; a
concert in a stadium; a book signing; an outdoor yoga class; a networking event; a school
reunion; a garden party; a volunteer beach clean-up; a football match in the rain
""")

TRIPS = items("""
a week at the beach; a ski trip; a business trip to Berlin; a weekend in Paris; a road trip
across the country; a camping trip with my kids; a cruise; a month backpacking in Southeast
Asia; a winter visit to Iceland; a family reunion out of town; a canoe trip; a weekend at a
cabin in the woods; a visit to my grandparents; a safari in Kenya; a long overnight ferry
crossing; a city break in Rome; a summer camp; a fishing trip; a weekend music festival; a trip
to the mountains in spring
""")

MEALS = items("""
a dinner party for six; a quick weeknight dinner; a vegetarian guest; a picnic; a kid's
birthday party; a romantic dinner at home; a potluck at work; breakfast in bed; a cold winter
evening; a hot summer lunch; friends who don't eat gluten; a movie night; a holiday brunch; a
tight budget this week; a camping stove; a lunchbox that stays good until noon
""")

SUBJECTS = items("""
a rainy Monday morning; an old bicycle; a cup of tea going cold; the first snow of the year; a
lost sock; a city at night; a grandmother's kitchen; a quiet library; a broken umbrella; an
empty playground; a long bus ride; the smell of fresh coffee; a cat asleep in the sun; a
houseplant that refuses to die; a paper boat; a full moon over a lake; moving house; the last
day of summer; a kite stuck in a tree; an old photograph; a pair of worn-out shoes; a thunder
storm; a busy harbour at dawn; autumn in the park; a bowl of soup; a letter that never arrived;
a lonely robot; a garden after the rain; a dog waiting at the door; friendship; growing older;
homesickness; a snowman melting; a first day at work; the sound of the sea; a fox in the city;
a forgotten birthday; the smell of pine trees; a traffic jam; a candle in the dark; Sunday
mornings; a library book that is overdue; a tiny apartment; the ticking of a clock; a long
walk home; a farmers' market; an old piano; waiting for the kettle to boil; a mountain
village; a child's drawing on the fridge
""")

CHARACTERS = items("""
a retired astronaut; a shy dragon; a clockmaker who never sleeps; a stray dog; a young
inventor; a grumpy wizard; a postman on his last day; a girl who can talk to birds; a robot
learning to cook; a pirate afraid of water; a detective who is always late; a tired
superhero; a little cloud; an old fisherman; a squirrel planning a heist; a ghost who is
afraid of people; a librarian with a secret; a boy who finds a talking stone; a knight who
hates fighting; a baker who only works at night; a time traveller stuck in 1950; a tortoise
who wants to fly; a new student at a magic school; a chef who lost his sense of taste; a
gardener on Mars
""")

LETTERS = items("""
my landlord asking to fix the heating; my neighbour asking them to keep their dog quiet at
night; a teacher thanking her for a great school year; my future self in ten years; a friend
I haven't spoken to in years; a company complaining about a late delivery; my team announcing
that I'm leaving; a hotel asking for a late check-out; a local newspaper about the lack of bike
lanes; my grandmother on her ninetieth birthday; a new neighbour welcoming them to the street;
a customer apologizing for a billing mistake; a coworker thanking them for their help; my
child's school asking for a meeting; the city council about a broken streetlight; a pen pal
in another country; my younger self on the first day of university; a gym cancelling my
membership
""")

STORIES = items("""
Snow White; Hansel and Gretel; The Little Mermaid; Pinocchio; Moby-Dick; Pride and Prejudice;
The Odyssey; Hamlet; Macbeth; Frankenstein; The Lion King; Finding Nemo; Jurassic Park; The
Wizard of Oz; Alice in Wonderland; Peter Pan; Robinson Crusoe; Don Quixote; The Hobbit;
Treasure Island; Little Red Riding Hood; Goldilocks and the Three Bears; The Three Little
Pigs; Jack and the Beanstalk; Sleeping Beauty; Rapunzel; The Ugly Duckling; The Tortoise and
the Hare; Beauty and the Beast; Aladdin; Oliver Twist; A Christmas Carol; Les Miserables; The
Great Gatsby; To Kill a Mockingbird; Nineteen Eighty-Four; Animal Farm; Charlotte's Web; The
Jungle Book; Gulliver's Travels; Dracula; Toy Story; Star Wars; The Matrix; Frozen; Shrek; The
Boy Who Cried Wolf; The Emperor's New Clothes; Romeo and Juliet; King Arthur and the sword in
the stone; Robin Hood; The Little Prince; Around the World in Eighty Days; Matilda; The Secret
Garden; Heidi; The Count of Monte Cristo; War of the Worlds
""")

CONCEPTS = items("""
compound interest; inflation; a blockchain; the stock market; photosynthesis; gravity; how
vaccines work; the greenhouse effect; supply and demand; a credit score; cloud storage; how
the internet works; machine learning; DNA; evolution; black holes; electricity; the immune
system; time zones; leap years; the placebo effect; opportunity cost; a budget deficit;
democracy; how elections work; taxes; insurance; a mortgage; recycling; the water cycle;
why we have seasons; how airplanes stay in the air; how a bill becomes a law; the theory of
relativity; probability; percentages; negative numbers; fractions; how a computer stores
data; encryption; what a search engine does; a password manager; two-factor authentication;
how GPS finds your location; nuclear energy; solar power; how muscles grow; metabolism;
calories; sleep cycles; antibiotics; the difference between speed and velocity; how bees
communicate; plate tectonics; the scientific method; a carbon footprint; interest rates;
a pension; the food chain; how rainbows form; how sound travels; how memory works in the
brain; what a gene is; a startup; a franchise; the gig economy
""")

AUDIENCES = items("""
a five-year-old; a ten-year-old; a teenager; my grandmother; my grandfather; a high school
student; a first-year university student; a busy manager; a new employee; a tourist; someone
who has just moved to this country; a retired teacher; a curious child; my parents; a friend
who hates maths; a complete beginner; a room full of farmers; a group of nurses; a football
coach; a kindergarten class; an artist; someone learning English; a sceptical friend
""")

NAMEABLES = items("""
a golden retriever puppy; a black kitten; a podcast about gardening; a food truck that sells
tacos; a book club; a fantasy kingdom; a small coffee roastery; a hiking group; a pet goldfish;
a family sailboat; a charity run; a science fiction spaceship; a board game about farming; a
home cleaning business; a YouTube channel about cooking on a budget; a rock band; a children's
bookstore; a knitting circle; a mobile app that tracks water intake; a vintage clothing shop; a
robot vacuum cleaner; a new brand of hot sauce; a chess club; a wedding hashtag; a family
newsletter; a fantasy novel's villain; a dragon in a bedtime story; a beekeeping blog; a
bicycle repair shop; a yoga studio; a houseplant; a team at a pub quiz
""")

IDEAS = items("""
a rainy weekend with kids; a tenth wedding anniversary; a science fair project; a
team-building activity; a birthday party for a seven-year-old; a gift for a coworker who is
retiring; a cheap date night; a school fundraiser; a short story; a Halloween costume; a
family game night; a gift for someone who has everything; a blog post about local history; a
New Year's resolution; a small garden in a shady yard; things to do on a long flight; a
weekend project with an old laptop; a healthy after-school snack; a theme for a dinner party;
a weekend in a small town; a mural on a school wall; a photography project; a hobby I can do
at home; a surprise for my partner; ways to use leftover rice; a community event in the park;
a first-week welcome for new staff; a classroom reward system; decorating a small balcony; a
summer reading list for teenagers
""")

PLANS = items("""
moving to a new apartment; a dinner party for six; the first week of learning Spanish;
cleaning the garage; a three-day trip to Rome; training for a 5 km run; a productive Saturday;
a child's birthday party; a small wedding; preparing for a new baby; a week of healthy
lunches; spring cleaning the house; the first month at a new job; studying for final exams; a
garden for the whole year; a weekend camping trip; starting a small online shop; a family
holiday on a budget; writing a novel in a year; getting fit in three months; repainting a
bedroom; a school science fair; a charity bake sale; organizing a family photo album; a
neighbourhood clean-up day; learning to code in six months; a surprise retirement party;
preparing my house for winter; a road trip along the coast; a week of meals without meat
""")

OBJECTS = items("""
a microwave oven; a smoke detector; a zipper; a thermos; an electric kettle; a dishwasher; a
washing machine; a vacuum cleaner; a ballpoint pen; a light bulb; a touchscreen; a bicycle
gear; a doorbell camera; an air conditioner; a hair dryer; a battery; a compass; a lock and
key; a toaster; a thermostat; a camera lens; an induction stove; a pressure cooker; a
wireless charger; a barcode scanner; a parking meter; an
elevator; an escalator; a solar-powered calculator; a quartz watch; a traffic light; a pencil
sharpener; a sewing machine; a coffee machine; an inhaler; a fire extinguisher
""")

FOODS = items("""
a ripe mango; durian; dark chocolate; blue cheese; fresh bread from the oven; kimchi; olives;
sparkling water; a lemon; coriander; wasabi; miso soup; a perfectly ripe peach; black coffee;
maple syrup; pickled ginger; coconut water; licorice; feta cheese; roasted chestnuts;
pomegranate seeds; grilled corn; matcha; fresh figs; sourdough toast with butter
""")

PLACES = items("""
a busy market in Marrakech; a small fishing village; a rainforest at dawn; the inside of a
submarine; a Japanese tea house; a snowy mountain cabin; a crowded subway at rush hour; an old
bookshop; a desert at night; a coral reef; a medieval castle; the top of a skyscraper; a
farmhouse kitchen; a busy airport; a Venetian canal; a quiet beach in winter; a jazz club; a
greenhouse full of orchids; a space station; a football stadium on match day
""")

ANIMALS = items("""
dogs; rabbits; horses; goats; sheep; pigs; parrots; penguins; dolphins; whales; octopuses;
elephants; giraffes; lions; tigers; wolves; foxes; bears; hedgehogs; bats; owls; crows;
eagles; hummingbirds; frogs; turtles; snakes; lizards; sharks; jellyfish; ants; honeybees;
spiders; butterflies; snails; camels; kangaroos; koalas; pandas; squirrels; hamsters;
guinea pigs; goldfish; ducks; swans; flamingos; seahorses; otters; beavers; raccoons
""")

HOBBIES = items("""
rock climbing; pottery; knitting; woodworking; birdwatching; baking; photography; calligraphy;
chess; gardening; kayaking; painting with watercolours; playing the ukulele; learning magic
tricks; stargazing; beekeeping; fishing; running; cycling; swimming; yoga; dancing salsa;
sewing; board games; geocaching; skateboarding; writing poetry; home brewing; origami;
playing the drums; bouldering; sketching; surfing; fencing; archery; scuba diving; candle
making; journaling; crossword puzzles; building model ships
""")

JOBS = items("""
a nurse; an electrician; a pilot; an architect; a veterinarian; a software engineer; a
librarian; a firefighter; a plumber; an accountant; a chef; a park ranger; a dentist; a graphic
designer; a translator; a data analyst; an air traffic controller; a pharmacist; a journalist;
a carpenter; a marine biologist; a social worker; a physiotherapist; a teacher; a lawyer; a
farmer; a barista; a museum curator; a paramedic; a game designer; a beekeeper; a tailor; a
zookeeper; a police officer; an interior designer
""")

CLOSINGS = items("""
Keep it short.; Please use simple words.; Answer in a few bullet points.; I'm a complete
beginner.; Explain it step by step.; I don't have much time, so be brief.; Thanks!; Start with
a quick answer, then the details.; Please don't make it too technical.; I'd like a friendly
answer.; One paragraph is enough.; What would you recommend?
""")

NUMBERS = ("two", "four", "five", "six", "seven", "ten")
SENTENCES = ("one sentence", "two sentences", "three sentences", "four sentences", "five sentences")
